package main

import (
	"bytes"
	"context"
	"io"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

func TestParseScale(t *testing.T) {
	for in, want := range map[string][]int{
		"1000000,10000000": {0, 1_000_000, 10_000_000},
		"1M,10M":           {0, 1_000_000, 10_000_000},
		" 10m , 250k,1M":   {0, 250_000, 1_000_000, 10_000_000},
		"0":                {0},
		"5,5,0,3":          {0, 3, 5},
	} {
		got, err := parseScale(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for in, why := range map[string]string{
		"-1":              `"-1" is not a record count (negative)`,
		"abc":             `"abc" is not a record count (not a whole number)`,
		"1M,-5":           `"-5" is not a record count (negative)`,
		"1.5M":            `"1.5M" is not a record count (not a whole number)`,
		"+3":              `"+3" is not a record count (not a whole number)`,
		"1e6":             `"1e6" is not a record count (not a whole number)`,
		"1,,2":            `"" is not a record count (empty)`,
		"M":               `"M" is not a record count (not a whole number)`,
		"":                "no record counts",
		"99999999999999M": `"99999999999999M" is not a record count (too large)`,
	} {
		_, err := parseScale(in)
		require.Error(t, err, in)
		assert.Contains(t, err.Error(), why, in)
		if in != "" {
			assert.Contains(t, err.Error(), "want a whole number of records, 0 or more, such as 1000000 or 1M", in)
		}
	}
	assert.Equal(t, []string{"0", "1M", "10M", "250k", "1234"},
		[]string{countName(0), countName(1_000_000), countName(10_000_000), countName(250_000), countName(1234)})
}

// The records the fill writes by hand are read back by the RedisStore's own
// claim as completed, with their response, and keep the retention.
func TestFillRedisLayout(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer c.Close()
	e := &env{redis: c, run: "t-", concurrency: 4}
	ctx := context.Background()
	const n = 2*redisPipeline + 7
	require.NoError(t, e.fillRedis(ctx, "idem:", n, io.Discard))
	assert.Len(t, mr.Keys(), n)

	s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	require.NoError(t, err)
	defer s.Close()
	for _, i := range []int{0, 1, 2, redisPipeline, n - 1} {
		k := scaleKey(e.run, i)
		got, err := s.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_x", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, idempotency.Completed, got.State, "record %d", i)
		assert.Equal(t, scaleOperationID(i), got.OperationID)
		assert.Equal(t, scaleResponse.Status, got.Response.Status)
		assert.Equal(t, scaleResponse.Header, got.Response.Header)
		assert.Equal(t, scaleResponse.Body, got.Response.Body)
		assert.Equal(t, retention, mr.TTL(redisRecordKey("idem:", k)))
	}
	assert.Len(t, scaleOperationID(12), len("op_")+26, "as long as the Guard's")
	require.NoError(t, checkFill(ctx, s, e.run, n))
	require.Error(t, checkFill(ctx, s, "other-", 1), "a record the fill did not write")

	require.NoError(t, e.unlinkPrefix(ctx, "idem:"))
	assert.Empty(t, slicesWithPrefix(mr.Keys(), "idem:"))
}

func slicesWithPrefix(keys []string, prefix string) []string {
	var out []string
	for _, k := range keys {
		if strings.HasPrefix(k, prefix) {
			out = append(out, k)
		}
	}
	return out
}

// The scale mode against real servers, at a small count: every figure is
// measured, no operation fails, and each store's table has its rows.
func TestRunScale(t *testing.T) {
	redisSrv := testserver.StartRedis(t)
	pg := testserver.StartPostgres(t)
	var stdout, stderr bytes.Buffer
	cfg := config{redisAddr: redisSrv.Addr, postgresDSN: pg.DSN, duration: 50 * time.Millisecond, runs: 1,
		concurrency: 4, sizeRecords: 200, rows: regexp.MustCompile(""), scale: []int{0, 3000}}
	require.NoError(t, run(context.Background(), cfg, &stdout, &stderr))

	out := stdout.String()
	assert.NotContains(t, out, "FAILED")
	assert.NotContains(t, out, "want", "a figure other than expected:\n%s", out)
	assert.Contains(t, out, "\nRedis ")
	assert.Contains(t, out, "\nPostgreSQL ")
	assert.Contains(t, out, "WARNING: a server given with -redis")
	assert.Regexp(t, `(?m)^ +records held +0 +3k +3k/0 *$`, out)
	for _, row := range []string{"new-operation ops/s", "new-operation p99 µs", "replay ops/s", "replay p99 µs",
		"Stats ms", "ListAbandoned(100) ms", "Sweep(100) ms"} {
		assert.Len(t, regexp.MustCompile(`(?m)^ *`+regexp.QuoteMeta(row)+` +[\d.]+ +[\d.]+ +[\d.]+ *$`).FindAllString(out, -1), 2, row)
	}
	assert.Len(t, regexp.MustCompile(`(?m)^ *bytes per record +- +\d+ *$`).FindAllString(out, -1), 2)
	assert.Regexp(t, `(?m)^ *DeleteExpired rows +0 +300 *$`, out)
	assert.Regexp(t, `(?m)^ *DeleteExpired ms, no traffic +[\d.]+ +[\d.]+ +[\d.]* *$`, out)
	assert.Regexp(t, `(?m)^ *rehash after fill s +[\d.]+ +[\d.]+ +[\d.]* *$`, out)
	assert.Regexp(t, `(?m)^ *new-operation p99 µs, no DeleteExpired +\d+ +\d+ +[\d.]+ *$`, out)

	// Nothing of the scale mode is left behind on a server it did not start.
	keys, err := redisSrv.Client().Keys(context.Background(), "*").Result()
	require.NoError(t, err)
	assert.Empty(t, keys)
}
