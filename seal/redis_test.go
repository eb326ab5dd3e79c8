package seal_test

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/seal"
)

// marker is in every body, header value, step result and request of the
// raw tests: a sealed store must keep it nowhere.
const marker = "MARKER-4111111111111111-cvv-737"

var (
	markedRequest = idempotency.FingerprintOf("POST /v1/charges", []byte(`{"card":"`+marker+`"}`))
	errCrash      = errors.New("the operation failed after its step")
)

// markedResponse is a response that carries marker in its body and in two
// header values.
func markedResponse(id string) idempotency.Response {
	return idempotency.Response{Status: http.StatusCreated,
		Header: http.Header{"X-Card": {marker}, "Set-Cookie": {"a=1", "session=" + marker}},
		Body:   []byte(`{"id":"` + id + `","card":"` + marker + `"}`)}
}

// stepThenFail runs an operation whose one step records marker and which
// then fails: its record is released and keeps the step's point.
func stepThenFail(ctx context.Context) (idempotency.Response, error) {
	if _, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ch_" + marker, nil }); err != nil {
		return idempotency.Response{}, err
	}
	return idempotency.Response{}, errCrash
}

// complete runs, through g, an operation that completes k with resp.
func complete(t *testing.T, g *idempotency.Guard, k idempotency.Key, resp idempotency.Response) {
	t.Helper()
	_, err := g.Do(t.Context(), k, markedRequest, func(context.Context) (idempotency.Response, error) { return resp, nil })
	require.NoError(t, err)
}

// mustNotRun is an operation that fails the test if it runs.
func mustNotRun(t *testing.T) func(context.Context) (idempotency.Response, error) {
	return func(context.Context) (idempotency.Response, error) {
		t.Error("the operation ran")
		return idempotency.Response{}, nil
	}
}

// rawValues returns every string value under prefix in rdb, by key: what
// a reader of the server (or of its backups) sees.
func rawValues(t *testing.T, rdb *redis.Client, prefix string) map[string]string {
	t.Helper()
	out := map[string]string{}
	iter := rdb.Scan(t.Context(), 0, prefix+"*", 1000).Iterator()
	for iter.Next(t.Context()) {
		k := iter.Val()
		if rdb.Type(t.Context(), k).Val() != "string" {
			continue // the leases index and the token sequence: keys and numbers
		}
		out[k] = rdb.Get(t.Context(), k).Val()
	}
	require.NoError(t, iter.Err())
	return out
}

// recordKey finds the Redis key of k's record under prefix.
func recordKey(t *testing.T, rdb *redis.Client, prefix string, k idempotency.Key) string {
	t.Helper()
	keys, err := rdb.Keys(t.Context(), fmt.Sprintf("%s{*}:%d:%s:%s", prefix, len(k.Scope), k.Scope, k.Name)).Result()
	require.NoError(t, err)
	require.Len(t, keys, 1, "the record of %v", k)
	return keys[0]
}

// leaks reports where in values the marker, or the request's bare
// fingerprint, appears.
func leaks(values map[string]string) []string {
	var where []string
	for k, v := range values {
		for _, secret := range []string{marker, string(markedRequest[:]), hex.EncodeToString(markedRequest[:])} {
			if strings.Contains(v, secret) || strings.Contains(k, secret) {
				where = append(where, k)
			}
		}
	}
	return where
}

// writeMarked leaves, through g, a released record with a recovery point
// (k1) and a completed one (k2), each carrying marker.
func writeMarked(t *testing.T, g *idempotency.Guard, k1, k2 idempotency.Key) {
	t.Helper()
	_, err := g.Do(t.Context(), k1, markedRequest, stepThenFail)
	require.ErrorIs(t, err, errCrash)
	complete(t, g, k2, markedResponse("ch_2"))
}

// What Redis keeps of a sealed store's records: no body, header value,
// step result or bare fingerprint, in the record or its points. The same
// operations on the bare store, as a control, keep the marker in clear.
func TestSealRawRedis(t *testing.T) {
	srv := testserver.StartRedis(t)
	rdb := srv.Client()
	t.Cleanup(func() { rdb.Close() })
	released, done := idempotency.Key{Scope: "acct_1", Name: "released"}, idempotency.Key{Scope: "acct_1", Name: "done"}

	bare := redisStore(t, srv.Client(), 0)
	writeMarked(t, idempotency.New(bare, idempotency.Options{}), released, done)
	require.NotEmpty(t, leaks(rawValues(t, rdb, "idem:")), "the control: the bare store keeps the marker in clear")

	inner, err := idempotency.NewRedisStore(srv.Client(), idempotency.RedisOptions{Prefix: "sealed:", CompressAbove: 1})
	require.NoError(t, err)
	t.Cleanup(func() { inner.Close() })
	s := sealed(t, inner, seal.Keys{Current: newKey(1)})
	g := idempotency.New(s, idempotency.Options{})
	writeMarked(t, g, released, done)

	raw := rawValues(t, rdb, "sealed:")
	assert.Empty(t, leaks(raw), "keys whose values hold the marker or the bare fingerprint")
	points := recordKey(t, rdb, "sealed:", released) + " points"
	require.Contains(t, raw, points, "the released record's recovery points")
	require.Contains(t, raw, recordKey(t, rdb, "sealed:", done), "the completed record")

	// The sealed store still answers with everything in clear.
	res, err := g.Do(t.Context(), done, markedRequest, mustNotRun(t))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, markedResponse("ch_2"), res.Response)
	var step string
	_, err = g.Do(t.Context(), released, markedRequest, func(ctx context.Context) (idempotency.Response, error) {
		step, err = idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "ran again", nil })
		return idempotency.Response{Status: http.StatusOK}, err
	})
	require.NoError(t, err)
	assert.Equal(t, "ch_"+marker, step, "the step's result, recorded before the release")

	// Inspect shows sizes and names, never a value.
	rec, err := s.Inspect(t.Context(), done)
	require.NoError(t, err)
	assert.NotContains(t, fmt.Sprintf("%#v", rec), marker)
	assert.Equal(t, len(markedResponse("ch_2").Body), rec.BodySize)
	assert.Equal(t, []string{"Set-Cookie", "X-Card"}, rec.HeaderNames)
}

// A sealed record copied, as it is, over another tenant's record of the
// same request, or over another key's record, does not open: the claim
// fails, and neither the copied response nor the operation is answered.
func TestSealRawRedisCopiedRecord(t *testing.T) {
	srv := testserver.StartRedis(t)
	rdb := srv.Client()
	t.Cleanup(func() { rdb.Close() })
	s := sealed(t, redisStore(t, srv.Client(), 0), seal.Keys{Current: newKey(1)})
	g := idempotency.New(s, idempotency.Options{})
	from := idempotency.Key{Scope: "acct_1", Name: "charge-1"}
	complete(t, g, from, markedResponse("ch_1"))
	value := rdb.Get(t.Context(), recordKey(t, rdb, "idem:", from)).Val()

	for _, to := range []idempotency.Key{{Scope: "acct_2", Name: "charge-1"}, {Scope: "acct_1", Name: "charge-2"}} {
		complete(t, g, to, idempotency.Response{Status: http.StatusCreated, Body: []byte(`{"id":"theirs"}`)})
		require.NoError(t, rdb.SetArgs(t.Context(), recordKey(t, rdb, "idem:", to), value, redis.SetArgs{KeepTTL: true}).Err())
		res, err := g.Do(t.Context(), to, markedRequest, mustNotRun(t))
		require.ErrorIs(t, err, seal.ErrUnopenable, "a claim of %v, holding the record of %v", to, from)
		assert.False(t, errors.Is(err, idempotency.ErrUnavailable), "an error FailOpen would run the handler on")
		assert.Zero(t, res)
	}
}
