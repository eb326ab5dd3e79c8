package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
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

// The whole program against real servers: every row runs twice without a
// failed operation, the rows carry their spread and commandstats, a
// waiting request's commands are counted, memory is measured and every
// budget is judged.
func TestRun(t *testing.T) {
	redisSrv := testserver.StartRedis(t)
	pg := testserver.StartPostgres(t)
	// The bench empties only a server it started itself.
	mine := redisSrv.Client()
	require.NoError(t, mine.Set(context.Background(), "not-the-bench's", "kept", 0).Err())
	var stdout, stderr bytes.Buffer
	cfg := config{redisAddr: redisSrv.Addr, postgresDSN: pg.DSN, duration: 50 * time.Millisecond, runs: 2,
		concurrency: 4, json: true, rows: regexp.MustCompile(""), sizeRecords: 200}
	require.NoError(t, run(context.Background(), cfg, &stdout, &stderr))

	var names []string
	rows := map[string]jsonRow{}
	sc := bufio.NewScanner(&stdout)
	for sc.Scan() {
		var r jsonRow
		require.NoError(t, json.Unmarshal(sc.Bytes(), &r), sc.Text())
		names = append(names, r.Name)
		rows[r.Name] = r
		assert.Positive(t, r.OpsPerSec, r.Name)
		assert.Positive(t, r.P50, r.Name)
		assert.GreaterOrEqual(t, r.P99, r.P50, r.Name)
		assert.Positive(t, r.AllocsPerOp, r.Name)
		assert.Equal(t, 2, r.Runs, r.Name)
		assert.Len(t, r.OpsPerSecRun, 2, r.Name)
		assert.LessOrEqual(t, r.OpsPerSecMin, r.OpsPerSec, r.Name)
		assert.GreaterOrEqual(t, r.OpsPerSecMax, r.OpsPerSec, r.Name)
		assert.Zero(t, r.Errors, r.Name)
		wantConcurrency := 4
		if strings.HasSuffix(r.Name, "@1") || r.Name == "redis/wake-up" {
			wantConcurrency = 1
		}
		assert.Equal(t, wantConcurrency, r.Concurrency, r.Name)
	}
	var want []string
	for _, r := range (&env{}).rows() {
		want = append(want, r.name)
		if r.baseline != "" {
			assert.Equal(t, r.baseline, rows[r.name].Baseline, r.name)
			assert.NotNil(t, rows[r.name].VsBaseline, r.name)
		}
	}
	assert.Equal(t, want, names)
	assert.Equal(t, "baseline/http-two-roundtrips", rows["redis/http-new-operation"].Baseline)
	assert.Equal(t, "baseline/http-one-roundtrip", rows["redis/http-replay"].Baseline)

	// Counts per operation are blurred by the operations in flight at each
	// end of a window, up to the row's concurrency at each end, with a call
	// or two apiece; on a loaded machine a 50ms window holds few operations
	// (CI runs counted 2.27 scripts a new operation at concurrency 1, and
	// 2.43 for the HTTP baseline at 4).
	blur := func(r jsonRow) float64 {
		return max(0.25, 2*float64(r.Concurrency)/(r.OpsPerSec*cfg.duration.Seconds()))
	}
	// The baseline's scripts are ours: two EVALSHAs, each one SET, one
	// round trip each.
	two := rows["baseline/two-roundtrips"]
	assert.InDelta(t, 2, two.RoundTrips, blur(two))
	assert.InDelta(t, 2, two.Commands["evalsha"].Calls, blur(two))
	assert.InDelta(t, 2, two.Commands["set"].Calls, blur(two))
	assert.NotContains(t, two.Commands, "info", "the meter's own commands")
	newAt1 := rows["redis/new-operation@1"]
	assert.InDelta(t, 2, newAt1.Commands["evalsha"].Calls, blur(newAt1), "claim and complete")
	httpTwo := rows["baseline/http-two-roundtrips"]
	assert.InDelta(t, 2, httpTwo.Commands["evalsha"].Calls, blur(httpTwo))
	assert.Empty(t, rows["baseline/http"].Commands["evalsha"])
	assert.Zero(t, rows["memory/new-operation"].RoundTrips)
	// redis-server's CPU only for the rows that run on it.
	assert.NotNil(t, rows["redis/new-operation"].ServerCPU)
	for _, name := range []string{"postgres/new-operation", "valkey/new-operation", "memory/new-operation"} {
		assert.Nil(t, rows[name].ServerCPU, name)
	}

	report := stderr.String()
	assert.NotContains(t, report, "FAILED")
	assert.Contains(t, report, "A waiting request sent 5 commands to Redis: evalsha 3, subscribe 1, unsubscribe 1\n")
	assert.Regexp(t, `(?m)^ +redis/new-operation +baseline/two-roundtrips *\n +command +calls/op +µs/op +calls/op +µs/op *\n +round trips +[\d.]+ +- +[\d.]+ +- *\n +evalsha +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ *\n`, report)
	assert.Regexp(t, `(?m)^ +redis/replay@1 +baseline/one-roundtrip@1 *$`, report)
	assert.Regexp(t, `\n +200-byte body,  6-byte key name: +\d+ bytes, overhead \d+ bytes\n`, report)
	assert.Regexp(t, `\n +200-byte body, 36-byte key name: +\d+ bytes, overhead \d+ bytes\n`, report)
	assert.Regexp(t, `\n +10240-byte body,  6-byte key name: +\d+ bytes, overhead \d+ bytes\n`, report)
	assert.Regexp(t, `\n +payment-intent\.json +201 +40 % +\d+ +\d+ % +\d+ +\d+ +\d+ *\n`, report)
	assert.Regexp(t, `\n +weighted mean +100 % +\d+ +\d+ % +\d+ +\d+ +\d+ *\n`, report)
	budgets := regexp.MustCompile(`(?m)^  (PASS|MISS)  `).FindAllString(report, -1)
	assert.Len(t, budgets, 14, "judged budgets in:\n%s", report)
	assert.Regexp(t, `(?m)^  redis/http-new-operation +\d+\.\d allocs/op, baseline/http-two-roundtrips +\d+\.\d \([+-]\d+\.\d\)$`, report)
	assert.Contains(t, report, "PostgreSQL 1")
	assert.NotContains(t, report, "FLUSHALL")
	assert.Equal(t, "kept", mine.Get(context.Background(), "not-the-bench's").Val())
}

// Without redis-server the program measures an embedded miniredis and says
// that its figures mean nothing; without PostgreSQL its rows are skipped.
func TestRunEmbedded(t *testing.T) {
	t.Setenv("PATH", t.TempDir()) // no redis-server to start
	var stdout, stderr bytes.Buffer
	cfg := config{postgresDSN: "postgres://postgres@127.0.0.1:1/none?connect_timeout=5", duration: 50 * time.Millisecond, runs: 2,
		concurrency: 4, sizeRecords: 200, rows: regexp.MustCompile("baseline/one|redis/replay|redis/wake-up|postgres/new|memory/new")}
	require.NoError(t, run(context.Background(), cfg, &stdout, &stderr))

	assert.Contains(t, stderr.String(), "WARNING: measuring an embedded miniredis")
	table := stdout.String()
	assert.NotContains(t, table, "FAILED")
	for _, name := range []string{"baseline/one-roundtrip", "redis/replay", "redis/replay@1", "redis/wake-up", "memory/new-operation"} {
		assert.Regexp(t, `(?m)^ *`+regexp.QuoteMeta(name)+` +\d+ +[+-]\d+/[+-]\d+ +\d+ +\d+ `, table)
	}
	assert.Regexp(t, `(?m)^ *redis/replay@1 .* \d+\.\d\d × one-roundtrip@1 \(\d\.\d\d–\d\.\d\d\)$`, table)
	assert.Regexp(t, `(?m)^ *postgres/new-operation +- +-`, table)
	assert.Contains(t, table, "postgres/new-operation: skipped: PostgreSQL not usable: ")
	assert.Contains(t, table, "Commands of a waiting request: not counted")
	assert.Contains(t, table, "not measured: needs INFO commandstats")
	assert.Contains(t, table, "not measured: miniredis")
	assert.Regexp(t, `\n +weighted mean +100 % +\d+ +\d+ % +- +- +- *\n`, table, "corpus sizes in no store")
	assert.Regexp(t, `n/a +postgres/new-operation ≥ 0\.9 × baseline/postgres-two-statements`, table)
	assert.Contains(t, table, "Redis miniredis (embedded)")
	assert.Contains(t, table, "emptied (FLUSHALL) before every run")
}

func TestSpreadOf(t *testing.T) {
	nan := math.NaN()
	for _, c := range []struct {
		in   []float64
		want spread
	}{
		{[]float64{3, 1, 2}, spread{2, 1, 3}},
		{[]float64{4, 1, 3, 2}, spread{2.5, 1, 4}},
		{[]float64{5}, spread{5, 5, 5}},
		{[]float64{nan, 7, 1, nan}, spread{4, 1, 7}},
	} {
		in := slices.Clone(c.in)
		assert.Equal(t, c.want, spreadOf(in), "%v", c.in)
		assert.Equal(t, fmt.Sprint(c.in), fmt.Sprint(in), "left as it was")
	}
	for _, in := range [][]float64{nil, {nan}} {
		s := spreadOf(in)
		assert.True(t, math.IsNaN(s.Median) && math.IsNaN(s.Min) && math.IsNaN(s.Max), "%v: %v", in, s)
	}
}

// runsOf makes a row whose runs did ops operations each in one second.
func runsOf(name string, ops ...uint64) *summary {
	s := &summary{Name: name}
	for _, n := range ops {
		s.Runs = append(s.Runs, &result{Ops: n, Elapsed: time.Second})
	}
	return s
}

// A ratio is taken run by run, and its median is not the ratio of the
// medians.
func TestRatioRunByRun(t *testing.T) {
	row, base := runsOf("row", 100, 300, 200), runsOf("base", 100, 100, 400)
	assert.Equal(t, spread{200, 100, 300}, row.ops())
	assert.Equal(t, spread{1, 0.5, 3}, row.ratio(base), "ratios 1, 3 and 0.5; the medians' would be 2")
}

// Run 1 of every row, then run 2 of every row.
func TestInterleave(t *testing.T) {
	var order [][2]int
	require.NoError(t, interleave(3, 2, func(row, run int) error {
		order = append(order, [2]int{row, run})
		return nil
	}))
	assert.Equal(t, [][2]int{{0, 0}, {1, 0}, {2, 0}, {0, 1}, {1, 1}, {2, 1}}, order)

	stop := errors.New("stop")
	calls := 0
	err := interleave(3, 2, func(row, run int) error {
		calls++
		if row == 1 {
			return stop
		}
		return nil
	})
	assert.ErrorIs(t, err, stop)
	assert.Equal(t, 2, calls, "nothing runs after an error")
}

// Each budget is judged on the median of its run-by-run ratios, a bound
// met exactly passes, and a budget whose rows did not run is n/a.
func TestBudgets(t *testing.T) {
	rep := &report{
		rows: []*summary{
			// Run by run 0.9, 0.79, 0.92: median 0.9, a pass, though the
			// medians' ratio is 950 / 1200 = 0.79.
			runsOf(at1(two), 1000, 1200, 1300),
			runsOf(at1(newOp), 900, 950, 1200),
			runsOf(two, 1000, 1000, 1000),
			runsOf(newOp, 990, 1000, 1200),
			runsOf(at1(one), 1000, 1000, 1000),
			runsOf(at1(replayOp), 1000, 1000, 1000),
			runsOf(at1(httpTwo), 1000, 1000, 1000),
			runsOf(at1(httpNewOp), 700, 800, 950),
			runsOf(httpTwo, 1000, 2000, 1000),
			runsOf(httpNewOp, 900, 1800, 900),
			runsOf(pgTwoStatements, 1000, 1000, 1000),
			runsOf(pgNewOp, 850, 900, 950),
			runsOf(pgOneSelect, 1000, 1000, 1000),
			runsOf(pgReplayOp, 700, 790, 900),
		},
		memory: []recordMemory{{Body: 200, Usage: 400}},
	}
	rep.row(at1(one)).Skipped = "not here" // and so not measured
	got := map[string]string{}
	for _, c := range budgets(rep) {
		got[c.what] = c.verdict
	}
	assert.Equal(t, map[string]string{
		"redis/new-operation@1 ≥ 0.9 × baseline/two-roundtrips@1":             "PASS",
		"redis/new-operation ≥ 1 × baseline/two-roundtrips":                   "PASS",
		"redis/replay@1 ≥ 0.95 × baseline/one-roundtrip@1":                    "n/a",
		"redis/http-new-operation@1 ≥ 0.9 × baseline/http-two-roundtrips@1":   "MISS",
		"redis/http-new-operation ≥ 0.9 × baseline/http-two-roundtrips":       "PASS",
		"postgres/new-operation@1 ≥ 0.9 × baseline/postgres-two-statements@1": "n/a",
		"postgres/new-operation ≥ 0.9 × baseline/postgres-two-statements":     "PASS",
		"postgres/replay@1 ≥ 0.8 × baseline/postgres-select@1":                "n/a",
		"postgres/replay ≥ 0.8 × baseline/postgres-select":                    "MISS",
		"postgres/one-commit@1 ≥ 0.85 × baseline/postgres-one-transaction@1":  "n/a",
		"postgres/one-commit ≥ 0.85 × baseline/postgres-one-transaction":      "n/a",
		"postgres/one-commit-replay@1 ≥ 0.8 × baseline/postgres-select@1":     "n/a",
		"postgres/one-commit-replay ≥ 0.8 × baseline/postgres-select":         "n/a",
		"Redis memory per 200-byte record ≤ body + 200 bytes":                 "PASS",
	}, got)

	rep.memory[0].Usage = 401
	assert.Equal(t, "MISS", budgets(rep)[13].verdict)
	assert.Equal(t, "0.90 ×  (0.79–0.92; 950 / 1200 ops/s)", budgets(rep)[0].got)
}

func TestCommandStats(t *testing.T) {
	// As Redis 7 answers INFO commandstats.
	before := parseCommandStats("# Commandstats\r\n" +
		"cmdstat_evalsha:calls=10,usec=57,usec_per_call=5.70,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_set:calls=4,usec=8,usec_per_call=2.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_info:calls=3,usec=100,usec_per_call=33.33,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_client|setinfo:calls=2,usec=3,usec_per_call=1.50,rejected_calls=0,failed_calls=0\r\n")
	assert.Equal(t, map[string]commandStat{
		"evalsha": {10, 57}, "set": {4, 8}, "info": {3, 100}, "client|setinfo": {2, 3},
	}, before)
	after := parseCommandStats("# Commandstats\r\n" +
		"cmdstat_evalsha:calls=30,usec=157,usec_per_call=5.23,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_set:calls=14,usec=28,usec_per_call=2.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_zadd:calls=5,usec=10,usec_per_call=2.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_info:calls=5,usec=160,usec_per_call=32.00,rejected_calls=0,failed_calls=0\r\n" +
		"cmdstat_client|setinfo:calls=2,usec=3,usec_per_call=1.50,rejected_calls=0,failed_calls=0\r\n")
	assert.Equal(t, map[string]perOp{
		"evalsha": {2, 10}, "set": {1, 2}, "zadd": {0.5, 1},
	}, commandsPerOp(before, after, 10), "info is the meter's; client|setinfo did nothing")
	assert.Nil(t, commandsPerOp(nil, after, 10), "not known")

	// A run that made no zadd counts as none in the median.
	s := &summary{Runs: []*result{
		{Commands: map[string]perOp{"evalsha": {2, 10}, "zadd": {1, 3}}},
		{Commands: map[string]perOp{"evalsha": {2, 20}}},
		{Commands: map[string]perOp{"evalsha": {2, 30}, "zadd": {1, 1}}},
	}}
	assert.Equal(t, map[string]perOp{"evalsha": {2, 20}, "zadd": {1, 1}}, s.commands())
	assert.Nil(t, (&summary{Runs: []*result{{}}}).commands())
}

// The commandstats section prints each library row beside its floor,
// evalsha first, a dash for a command one side did not make, and leaves
// out what rounds to no call per operation.
func TestWriteCommands(t *testing.T) {
	runOf := func(trips float64, cmds map[string]perOp) *result {
		return &result{Ops: 1000, Elapsed: time.Second, RoundTrips: trips, Commands: cmds}
	}
	newOpRow, twoRow := runsOf(newOp, 1000), runsOf(two, 1000)
	newOpRow.Runs[0] = runOf(0.25, map[string]perOp{"evalsha": {2, 30}, "get": {2, 1.5}, "zadd": {1, 2}, "hello": {0.001, 0.01}})
	twoRow.Runs[0] = runOf(2, map[string]perOp{"evalsha": {2, 10}, "set": {2, 3.25}})
	var b bytes.Buffer
	writeCommands(&b, &report{rows: []*summary{twoRow, newOpRow}, runs: 1})
	out := b.String()
	assert.Regexp(t, `(?m)^ +redis/new-operation +baseline/two-roundtrips *\n`+
		` +command +calls/op +µs/op +calls/op +µs/op *\n`+
		` +round trips +0\.25 +- +2\.00 +- *\n`+
		` +evalsha +2\.00 +30\.00 +2\.00 +10\.00 *\n`+
		` +get +2\.00 +1\.50 +- +- *\n`+
		` +set +- +- +2\.00 +3\.25 *\n`+
		` +zadd +1\.00 +2\.00 +- +- *\n$`, out)
	assert.NotContains(t, out, "hello")

	b.Reset()
	writeCommands(&b, &report{rows: []*summary{runsOf(two, 1000), runsOf(newOp, 1000)}, runs: 1})
	assert.Contains(t, b.String(), "not measured: needs INFO commandstats", "rows without commandstats")
}
