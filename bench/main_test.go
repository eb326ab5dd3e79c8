package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"math"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testserver"
)

// Every value lands in a bucket whose middle is within 1/64 of it, and
// buckets never go backwards.
func TestHistogramBuckets(t *testing.T) {
	prev := -1
	for v := uint64(0); v < 1<<40; v = v*17/16 + 1 {
		b := bucketOf(v)
		require.GreaterOrEqual(t, b, prev, "bucket of %d", v)
		require.Less(t, b, len(histogram{}), "bucket of %d", v)
		prev = b
		if v > 0 {
			require.InEpsilon(t, float64(v), bucketMid(b), 1.0/64, "value %d in bucket %d", v, b)
		}
	}
}

func TestHistogramQuantiles(t *testing.T) {
	var h histogram
	assert.True(t, math.IsNaN(h.quantile(0.5)), "quantile of nothing")
	// 1..1000 µs, one each.
	for us := 1; us <= 1000; us++ {
		h.record(time.Duration(us) * time.Microsecond)
	}
	var twice histogram
	twice.add(&h)
	twice.add(&h)
	for _, hh := range []*histogram{&h, &twice} {
		assert.InEpsilon(t, 500, hh.quantile(0.5), 1.0/64)
		assert.InEpsilon(t, 990, hh.quantile(0.99), 1.0/64)
		assert.InEpsilon(t, 1000, hh.quantile(1), 1.0/64)
	}
	assert.Equal(t, uint64(2000), twice.count())
}

func TestJSONBody(t *testing.T) {
	for _, size := range []int{64, 200, 10 << 10} {
		b := jsonBody(size)
		assert.Len(t, b, size)
		assert.True(t, json.Valid(b), "%d bytes: %s", size, b)
		assert.Equal(t, b, jsonBody(size), "the same on every run")
	}
}

// The whole program against real servers: every row runs without a failed
// operation, a waiting request's commands are counted, memory is measured
// and every budget is judged.
func TestRun(t *testing.T) {
	redisSrv := testserver.StartRedis(t)
	pg := testserver.StartPostgres(t)
	var stdout, stderr bytes.Buffer
	cfg := config{redisAddr: redisSrv.Addr, postgresDSN: pg.DSN, duration: 100 * time.Millisecond,
		concurrency: 4, json: true, rows: regexp.MustCompile("")}
	require.NoError(t, run(context.Background(), cfg, &stdout, &stderr))

	var names []string
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		var r struct {
			Name        string   `json:"name"`
			OpsPerSec   float64  `json:"ops_per_sec"`
			P50         float64  `json:"p50_us"`
			P99         float64  `json:"p99_us"`
			AllocsPerOp *float64 `json:"allocs_per_op"`
		}
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
		names = append(names, r.Name)
		assert.Positive(t, r.OpsPerSec, r.Name)
		assert.Positive(t, r.P50, r.Name)
		assert.GreaterOrEqual(t, r.P99, r.P50, r.Name)
		assert.NotNil(t, r.AllocsPerOp, r.Name)
	}
	want := []string{}
	for _, r := range (&env{}).rows() {
		want = append(want, r.name)
	}
	assert.Equal(t, want, names)

	report := stderr.String()
	assert.NotContains(t, report, "FAILED")
	assert.Contains(t, report, "A waiting request sent 5 commands to Redis: evalsha 3, subscribe 1, unsubscribe 1\n")
	assert.Regexp(t, `\n +200-byte body: +\d+ bytes, overhead \d+ bytes\n`, report)
	assert.Regexp(t, `\n +10240-byte body: +\d+ bytes, overhead \d+ bytes\n`, report)
	budgets := regexp.MustCompile(`(?m)^  (PASS|MISS)  `).FindAllString(report, -1)
	assert.Len(t, budgets, 5, "judged budgets in:\n%s", report)
	assert.Contains(t, report, "PostgreSQL 1")
}

// Without redis-server the program measures an embedded miniredis and says
// that its figures mean nothing; without PostgreSQL its rows are skipped.
func TestRunEmbedded(t *testing.T) {
	t.Setenv("PATH", t.TempDir()) // no redis-server to start
	var stdout, stderr bytes.Buffer
	cfg := config{postgresDSN: "postgres://postgres@127.0.0.1:1/none?connect_timeout=5", duration: 50 * time.Millisecond,
		concurrency: 4, rows: regexp.MustCompile("baseline/one|redis/replay|redis/wake-up|postgres/new|memory/new")}
	require.NoError(t, run(context.Background(), cfg, &stdout, &stderr))

	assert.Contains(t, stderr.String(), "WARNING: measuring an embedded miniredis")
	table := stdout.String()
	assert.NotContains(t, table, "FAILED")
	for _, name := range []string{"baseline/one-roundtrip", "redis/replay", "redis/wake-up", "memory/new-operation"} {
		assert.Regexp(t, `(?m)^ *`+name+` +\d+ +\d+ +\d+ `, table)
	}
	assert.Regexp(t, `(?m)^ *postgres/new-operation +- +-`, table)
	assert.Contains(t, table, "postgres/new-operation: skipped: PostgreSQL not usable: ")
	assert.Contains(t, table, "Commands of a waiting request: not counted")
	assert.Contains(t, table, "not measured: miniredis")
	assert.Regexp(t, `n/a +redis/new-operation ≥ 6 × postgres/new-operation`, table)
	assert.Contains(t, table, "Redis miniredis (embedded)")
}
