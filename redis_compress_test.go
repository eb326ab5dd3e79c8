package idempotency

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRedisCompressAbove: with RedisOptions.CompressAbove, a body above it
// is kept compressed, one at or below it plain; every store replays and
// inspects either exactly, whether it compresses or not.
func TestRedisCompressAbove(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		compressing := newRedisStoreWith(t, c, RedisOptions{CompressAbove: 1024})
		plain := newRedisStore(t, c)
		json := strings.Repeat(`{"id":"ch_1","amount":1200,"currency":"eur","status":"succeeded"},`, 160)
		for _, tc := range []struct {
			name       string
			body       string
			compressed bool
		}{
			{"large", json, true},
			{"at the threshold", json[:1024], false},
		} {
			k := Key{Scope: "acct", Name: "compress-" + strings.ReplaceAll(tc.name, " ", "-")}
			resp := Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(tc.body)}
			req := ClaimRequest{Key: k, Fingerprint: FingerprintOf("charge", nil), OperationID: "op-" + k.Name, Lease: time.Minute, Retention: time.Hour}
			owner, err := compressing.Claim(ctx, req)
			require.NoError(t, err)
			require.NoError(t, compressing.Complete(ctx, k, owner.Token, resp, time.Hour))
			ks, _ := compressing.keysOf(k)
			size, err := c.StrLen(ctx, ks.rec).Result()
			require.NoError(t, err)
			if tc.compressed {
				assert.Less(t, size, int64(len(tc.body)/3), "%s: the stored record", tc.name)
			} else {
				assert.Greater(t, size, int64(len(tc.body)), "%s: the stored record", tc.name)
			}
			for name, s := range map[string]*RedisStore{"compressing": compressing, "plain": plain} {
				replay, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: req.Fingerprint, OperationID: "op-again", Lease: time.Minute, Retention: time.Hour})
				require.NoError(t, err)
				require.Equal(t, Completed, replay.State, "%s, %s store", tc.name, name)
				assert.Equal(t, resp, replay.Response, "%s, %s store: the replay", tc.name, name)
				r, err := s.Inspect(ctx, k)
				require.NoError(t, err)
				assert.Equal(t, len(tc.body), r.BodySize, "%s, %s store: the body size inspected", tc.name, name)
			}
		}
	})
}
