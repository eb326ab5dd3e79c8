package idempotency

import (
	"context"
	"math"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/internal/wire"
)

func TestRedisKeyLayout(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer c.Close()
	s, err := NewRedisStore(c, RedisOptions{Prefix: "p:"})
	require.NoError(t, err)
	rec, bk := s.recordKey(Key{Scope: "acct:1", Name: "k}{x"})
	tag := rec[:strings.IndexByte(rec, '}')+1]
	assert.True(t, strings.HasPrefix(rec, "p:{"), rec)
	for _, key := range []any{bk.seq, bk.leases} {
		assert.True(t, strings.HasPrefix(key.(string), tag), "record %q and %q must share a hash tag", rec, key)
	}

	// A scope that ends like a name starts cannot pass for another pair.
	a, _ := s.recordKey(Key{Scope: "a:1", Name: "b"})
	b, _ := s.recordKey(Key{Scope: "a", Name: "1:b"})
	assert.NotEqual(t, a, b)

	// The recovery points' key follows the record's, in its hash slot, and
	// is no record's key: read as one, its name is no valid key's, whatever
	// bytes the scope holds.
	for _, k := range []Key{{Scope: "acct:1", Name: "k}{x"}, {Scope: "a points", Name: "b"}, {Scope: "\x00\xff :", Name: "~"}} {
		ks, _ := s.keysOf(k)
		rec, _ := s.recordKey(k)
		assert.Equal(t, rec, ks.rec)
		assert.Equal(t, rec+pointsSuffix, ks.points)
		tag := s.bucketTag(bucketOf(k))
		assert.True(t, strings.HasPrefix(ks.points, tag), "record %q and %q must share a hash tag", rec, ks.points)
		read, ok := parseRecordName(strings.TrimPrefix(ks.points, tag))
		require.True(t, ok, "%q", ks.points)
		assert.Equal(t, k.Scope, read.Scope)
		assert.ErrorIs(t, read.Validate(), ErrInvalidKey, "points key %q read as the record key of %q", ks.points, read)
	}

	_, err = NewRedisStore(c, RedisOptions{Prefix: "x{"})
	assert.ErrorContains(t, err, "holds a brace")
}

// TestRecordLayout checks that lua/record.lua and redis_record.go lay a
// record out alike: the names they give the states and offsets, and the
// records the scripts write in every state, read back by the Go constants.
func TestRecordLayout(t *testing.T) {
	t.Run("names", func(t *testing.T) {
		lua := func(pattern string) []string {
			m := regexp.MustCompile(`(?m)^local ` + pattern + `$`).FindStringSubmatch(recordLua)
			require.NotNil(t, m, "lua/record.lua has no line matching %q", pattern)
			return m[1:]
		}
		states := lua(`COMPLETED, IN_FLIGHT, RELEASED = '(.)', '(.)', '(.)'`)
		assert.Equal(t, []string{string(rune(recordCompleted)), string(rune(recordInFlight)), string(rune(recordReleased))}, states)
		offsets := lua(`FINGERPRINT_FIRST, FINGERPRINT_LAST = (\d+), (\d+)`)
		// Lua counts from 1, Go from 0.
		assert.Equal(t, []string{strconv.Itoa(recordFingerprintAt + 1), strconv.Itoa(recordOperationIDLenAt)}, offsets)
		assert.Equal(t, []string{strconv.Itoa(recordOperationIDLenAt + 1)}, lua(`OP_LEN_AT = (\d+)`))
	})

	redisBackends(t, func(t *testing.T, c *redis.Client) {
		ctx := context.Background()
		s := newRedisStore(t, c)
		k := Key{Scope: "acct", Name: "layout"}
		fp := FingerprintOf("charge", []byte(`{"amount":1}`))
		rec, _ := s.recordKey(k)
		raw := func() string {
			v, err := c.Get(ctx, rec).Result()
			require.NoError(t, err)
			require.Greater(t, len(v), recordOperationIDAt, "record %q", v)
			assert.Equal(t, string(fp[:]), v[recordFingerprintAt:recordOperationIDLenAt], "fingerprint")
			return v
		}
		opID := func(v string) string {
			return v[recordOperationIDAt : recordOperationIDAt+int(v[recordOperationIDLenAt])]
		}
		// fields reads the fields of a record in flight or released.
		fields := func(v string) []string {
			f := strings.SplitN(v[recordOperationIDAt+len(opID(v)):], " ", 5)
			require.Len(t, f, 5, "record %q", v)
			return f
		}
		claim := func(id string) Claim {
			c, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: id, Lease: time.Minute, Retention: time.Hour})
			require.NoError(t, err)
			require.Equal(t, Owner, c.State)
			return c
		}

		first := claim("op-1")
		v := raw()
		assert.Equal(t, byte(recordInFlight), v[0])
		assert.Equal(t, "op-1", opID(v))
		f := fields(v)
		assert.Equal(t, []string{strconv.FormatUint(first.Token, 10), "1", "00", ""}, f[1:], "token, attempt, abandoned and waited, claimer")

		require.NoError(t, s.Abandon(ctx, k, first.Token))
		second := claim("op-2")
		require.True(t, second.Abandoned)
		v = raw()
		assert.Equal(t, byte(recordInFlight), v[0])
		assert.Equal(t, "op-1", opID(v), "a takeover keeps the operation ID")
		assert.Equal(t, []string{strconv.FormatUint(second.Token, 10), "2", "10", "op-2"}, fields(v)[1:])

		require.NoError(t, s.Release(ctx, k, second.Token))
		v = raw()
		assert.Equal(t, byte(recordReleased), v[0])
		assert.Equal(t, "op-1", opID(v))

		third := claim("op-3")
		resp := Response{Status: 201, Header: map[string][]string{"Location": {"/v1/charges/1"}}, Body: []byte(`{"id":1}`)}
		require.NoError(t, s.Complete(ctx, k, third.Token, resp, time.Hour))
		v = raw()
		assert.Equal(t, byte(recordCompleted), v[0])
		assert.Equal(t, "op-1", opID(v))
		stored := v[recordOperationIDAt+len("op-1"):]
		assert.Equal(t, string(wire.AppendResponse(nil, resp.Status, resp.Header, resp.Body)), stored, "the stored response")
		got, err := completedClaim(v)
		require.NoError(t, err)
		assert.Equal(t, Claim{State: Completed, OperationID: "op-1", Response: resp}, got)
	})
}

// FuzzCompletedClaim: a claim reply read as a completed record, whatever its
// bytes (a value another program wrote under a record's key, one truncated,
// one from another version), is an error or a claim cut from those bytes:
// never a panic. A record the layout describes reads back as it was made.
func FuzzCompletedClaim(f *testing.F) {
	made := func(op string, status int, body string) string {
		rec := string(recordCompleted) + strings.Repeat("f", len(Fingerprint{})) + string(rune(len(op))) + op
		return string(wire.AppendResponse([]byte(rec), status, map[string][]string{"Content-Type": {"application/json"}}, []byte(body)))
	}
	f.Add("op_1", 201, `{"id":"ch_1"}`, 0)
	f.Add("op_A2345678901234567890123456", 200, "", 3)
	f.Add("o", 599, "\x00\xff", 40)
	f.Fuzz(func(t *testing.T, op string, status int, body string, cut int) {
		if len(op) == 0 || len(op) > 127 || status < 100 || status > 999 {
			return // not what a Complete writes; the cut bytes below still are tried
		}
		rec := made(op, status, body)
		c, err := completedClaim(rec)
		if err != nil {
			t.Fatalf("a record as Complete writes it: %v", err)
		}
		if c.State != Completed || c.OperationID != op || c.Response.Status != status || string(c.Response.Body) != body ||
			c.Response.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("read back %+v, want op %q, status %d, body %q", c, op, status, body)
		}
		// Any prefix, and any single byte changed: an error or a claim, no
		// panic, and never a body longer than the bytes after the head.
		cut = max(cut, 0) % (len(rec) + 1)
		for _, v := range []string{rec[:cut], rec[:cut] + "\xff" + rec[min(cut+1, len(rec)):]} {
			if c, err := completedClaim(v); err == nil && len(c.Response.Body) > len(v) {
				t.Fatalf("%q: a body of %d bytes from %d bytes", v, len(c.Response.Body), len(v))
			}
		}
	})
}

// TestRedisForeignRecords runs the seeds of FuzzRecordScripts on
// redis-server, whose Lua is not miniredis's: a value under a record's key
// that the scripts did not write never makes a caller the owner, never
// replays, and never panics.
func TestRedisForeignRecords(t *testing.T) {
	c := testserver.StartRedis(t).Client()
	s := newRedisStore(t, c)
	values, calls := 0, 0
	for _, seed := range recordSeeds() {
		calls += checkRecordScripts(t, s, c, seed.value, seed.token)
		values++
	}
	report.Add(t, report.Entry{Suite: "fuzz", Store: "redis", Faults: map[string]int{"foreign-value": values}, Operations: calls})
}

// TestParseClaimImpossibleReplies: replies that the scripts give only for a
// value this version never writes, with numbers beyond what Lua formats
// exactly or an operation ID of 0 bytes, fail the claim; none makes an owner
// with a made-up attempt, a waiter that re-reads at once, or a replay.
func TestParseClaimImpossibleReplies(t *testing.T) {
	fp := strings.Repeat("f", len(Fingerprint{}))
	for _, reply := range []any{
		// Redis's string.format('%d') of an attempt of 1e20, plus one.
		[]any{"owner", "op_1", "-9223372036854775808", "5", "0"},
		[]any{"owner", "op_1", "0", "5", "0"},
		[]any{"owner", "", "2", "5", "1"},
		// Of a deadline of 1e20 less now.
		[]any{"inflight", "-9223372036854775808"},
		[]any{"inflight", "0"},
		[]any{"inflight", strconv.FormatInt(int64(math.MaxInt64/time.Millisecond)+1, 10)},
		"c" + fp + "\x00" + string(wire.AppendResponse(nil, 201, nil, []byte("ok"))),
	} {
		c, err := parseClaim(reply, "op_new")
		assert.Error(t, err, "%q read as %+v", reply, c)
	}
	c, err := parseClaim([]any{"inflight", strconv.FormatInt(int64(math.MaxInt64/time.Millisecond), 10)}, "op_new")
	require.NoError(t, err)
	assert.Positive(t, c.LeaseLeft, "the longest lease left")
}

// A value this version did not write, indexed as in flight (a record that
// was corrupted, or rewritten by another program, after its claim), is
// dropped from the in-flight index by the listing and does not fail it: the
// abandoned records of every other key are still listed, for Sweep.
func TestAbandonedSkipsForeignRecords(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		ctx := context.Background()
		fp := FingerprintOf("op", nil)
		dead := Key{Name: "dead"}
		_, err := s.Claim(ctx, ClaimRequest{Key: dead, Fingerprint: fp, OperationID: "op_dead", Lease: time.Millisecond, Retention: time.Hour})
		require.NoError(t, err)
		foreign := Key{Name: "foreign"}
		rec, bk := s.recordKey(foreign)
		// A deadline of 16 digits, which decode refuses.
		require.NoError(t, c.Set(ctx, rec, "p"+string(fp[:])+"\x04op_1"+"1000000000000000 7 1 00 ", time.Hour).Err())
		require.NoError(t, c.ZAdd(ctx, bk.leases.(string), redis.Z{Score: 1, Member: rec}).Err())
		time.Sleep(5 * time.Millisecond)

		got, err := s.ListAbandoned(ctx, 10)
		require.NoError(t, err)
		require.Len(t, got, 1)
		assert.Equal(t, dead, got[0].Key)
		_, err = c.ZScore(ctx, bk.leases.(string), rec).Result()
		assert.ErrorIs(t, err, redis.Nil, "the foreign value's index entry was kept")
	})
}
