package main

// The scale mode (-scale): how the stores' costs move with the records they
// hold. For each store and each count N it fills the store with N retained,
// completed records, written straight in the store's own layout rather
// than through Guard.Do, leaves a few records abandoned and a few in
// flight, and measures what a deployment pays per call: a new operation, a
// replay of one of the N, Stats, ListAbandoned, a sweep and, on PostgreSQL,
// DeleteExpired beside live traffic.

import (
	"bytes"
	"context"
	"crypto/md5"
	crand "crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/wire"
	"github.com/idempotency-go/idempotency/postgres"
)

// parseScale reads -scale: a comma-separated list of record counts, each a
// whole number, with an optional k (thousand) or M (million). It returns
// them sorted, without duplicates, 0 (the empty store) always first.
func parseScale(s string) ([]int, error) {
	if strings.TrimSpace(s) == "" {
		return nil, errors.New("no record counts: want a comma-separated list such as 1000000,10000000 (or 1M,10M)")
	}
	counts := []int{0}
	for _, item := range strings.Split(s, ",") {
		n, err := parseCount(strings.TrimSpace(item))
		if err != nil {
			return nil, err
		}
		counts = append(counts, n)
	}
	slices.Sort(counts)
	return slices.Compact(counts), nil
}

// parseCount reads one record count of -scale.
func parseCount(item string) (int, error) {
	bad := func(why string) (int, error) {
		return 0, fmt.Errorf("%q is not a record count (%s): want a whole number of records, 0 or more, such as 1000000 or 1M", item, why)
	}
	digits, mult := item, 1
	switch {
	case strings.HasSuffix(item, "k"), strings.HasSuffix(item, "K"):
		digits, mult = item[:len(item)-1], 1_000
	case strings.HasSuffix(item, "M"), strings.HasSuffix(item, "m"):
		digits, mult = item[:len(item)-1], 1_000_000
	}
	switch {
	case item == "":
		return bad("empty")
	case strings.HasPrefix(digits, "-"):
		return bad("negative")
	case digits == "" || strings.Trim(digits, "0123456789") != "":
		return bad("not a whole number")
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n > math.MaxInt/mult {
		return bad("too large")
	}
	return n * mult, nil
}

// countName spells a record count for a column heading: 1M, 250k, 1234.
func countName(n int) string {
	switch {
	case n == 0:
		return "0"
	case n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n%1_000 == 0:
		return strconv.Itoa(n/1_000) + "k"
	}
	return strconv.Itoa(n)
}

const (
	// scaleUnsettled is how many records the scale mode leaves abandoned,
	// and how many more in flight under a live lease, beside the N
	// completed ones: work for Stats, ListAbandoned and the sweep.
	scaleUnsettled = 1000
	// scaleListed is the limit of every ListAbandoned and Sweep call.
	scaleListed = 100
	// scaleCalls is how many times Stats and ListAbandoned are called at
	// each count; the sweep, which settles what it finds, is called
	// scaleSweeps times.
	scaleCalls, scaleSweeps = 5, 3
	// redisPipeline and pgChunk are the records of one fill command.
	redisPipeline, pgChunk = 1_000, 100_000
	// scaleSchema holds the PostgreSQL store of the scale mode, apart from
	// any other table of the database; it is dropped at the end.
	scaleSchema = "bench_scale"
)

// The records of the fill: a 200-byte JSON body with its Content-Type,
// under one of a few scopes, the bench's fingerprint.
var (
	scaleScopes   = []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d"}
	scaleResponse = idempotency.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}},
		Body:   jsonBody(200),
	}
	// scaleStored is scaleResponse as every store keeps it.
	scaleStored = wire.AppendResponse(nil, scaleResponse.Status, scaleResponse.Header, scaleResponse.Body)
)

// scaleKey is the key of the i-th record of the fill; run is unique to the
// process, as the bench's keys are.
func scaleKey(run string, i int) idempotency.Key {
	return idempotency.Key{Scope: scaleScopes[i%len(scaleScopes)], Name: run + "r" + strconv.Itoa(i)}
}

// scaleOperationID is the operation ID of the i-th record of the fill, as
// long as the Guard's ("op_" and 26 characters), and the same as the SQL
// fill's: 'op_' || substr(md5(i::text), 1, 26).
func scaleOperationID(i int) string {
	sum := md5.Sum([]byte(strconv.Itoa(i)))
	return "op_" + hex.EncodeToString(sum[:])[:26]
}

// scaleTable is the report of one store: one column per record count.
type scaleTable struct {
	title  string
	counts []int
	rows   []*scaleRow
	notes  []string
}

// scaleRow is one figure at every count; NaN where not measured.
type scaleRow struct {
	name   string
	digits int
	vals   []float64
}

func newScaleTable(title string, counts []int) *scaleTable {
	return &scaleTable{title: title, counts: counts}
}

// set records the figure of row at the count of column col. Rows print in
// the order they were first set.
func (t *scaleTable) set(row string, digits, col int, v float64) {
	for _, r := range t.rows {
		if r.name == row {
			r.vals[col] = v
			return
		}
	}
	r := &scaleRow{name: row, digits: digits, vals: make([]float64, len(t.counts))}
	for i := range r.vals {
		r.vals[i] = math.NaN()
	}
	r.vals[col] = v
	t.rows = append(t.rows, r)
}

func (t *scaleTable) note(format string, args ...any) {
	t.notes = append(t.notes, fmt.Sprintf(format, args...))
}

func (t *scaleTable) write(w io.Writer) {
	fmt.Fprintf(w, "\n%s\n", t.title)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprint(tw, "records held\t")
	for _, n := range t.counts {
		fmt.Fprintf(tw, "%s\t", countName(n))
	}
	last := t.counts[len(t.counts)-1]
	fmt.Fprintf(tw, "%s/0\t\n", countName(last))
	for _, r := range t.rows {
		fmt.Fprintf(tw, "%s\t", r.name)
		for _, v := range r.vals {
			if math.IsNaN(v) {
				fmt.Fprint(tw, "-\t")
			} else {
				fmt.Fprintf(tw, "%.*f\t", r.digits, v)
			}
		}
		first, end := r.vals[0], r.vals[len(r.vals)-1]
		if len(r.vals) > 1 && math.Round(first*math.Pow(10, float64(r.digits))) > 0 && !math.IsNaN(end) {
			fmt.Fprintf(tw, "%.2f\t\n", end/first)
		} else {
			fmt.Fprint(tw, "\t\n")
		}
	}
	tw.Flush()
	for _, n := range t.notes {
		fmt.Fprintln(w, "  "+n)
	}
}

// runScale is the scale mode: a table per store, Redis first, then
// PostgreSQL; stores whose name does not match -rows are left out.
func (e *env) runScale(ctx context.Context, cfg config, stdout, stderr io.Writer) error {
	var tables []*scaleTable
	var skipped []string
	if cfg.rows.MatchString("redis") {
		switch {
		case e.embedded:
			skipped = append(skipped, "Redis: not measured: an embedded miniredis says nothing about records held")
		default:
			t, err := e.scaleRedis(ctx, cfg, stderr)
			if err != nil {
				return fmt.Errorf("scale, redis: %w", err)
			}
			tables = append(tables, t)
		}
	}
	if cfg.rows.MatchString("postgres") {
		switch {
		case e.pgNaive == nil:
			skipped = append(skipped, "PostgreSQL: not measured: "+e.pgSkip)
		default:
			t, err := e.scalePostgres(ctx, cfg, stderr)
			if err != nil {
				return fmt.Errorf("scale, postgres: %w", err)
			}
			tables = append(tables, t)
		}
	}
	fmt.Fprintf(stdout, "Records held: N completed records (a %d-byte JSON body and its Content-Type, %d scopes, %v retention),\n"+
		"plus %d abandoned and %d in flight; %d concurrent operations; ops/s and latencies are medians of %d runs of %v.\n",
		len(scaleResponse.Body), len(scaleScopes), retention, scaleUnsettled, scaleUnsettled, cfg.concurrency, cfg.runs, cfg.duration)
	for _, t := range tables {
		t.write(stdout)
	}
	fmt.Fprintln(stdout)
	for _, s := range skipped {
		fmt.Fprintln(stdout, s)
	}
	fmt.Fprintf(stdout, "Machine: %s/%s, %d CPUs, %s; client and servers share it\n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.Version())
	return nil
}

// scaleStore is what the measurements common to every store need.
type scaleStore struct {
	name  string
	store idempotency.Store
	stats func(context.Context) (idempotency.Stats, error)
	// before, if set, is called as each measurement begins.
	before func(what string)
}

// measureScale makes the unsettled records, checks the fill, then measures
// new operations, replays, Stats, ListAbandoned and sweeps on s holding n
// filled records, into column col of t.
func (e *env) measureScale(ctx context.Context, cfg config, t *scaleTable, col, n int, s scaleStore, log io.Writer) error {
	if err := e.makeUnsettled(ctx, s.store); err != nil {
		return fmt.Errorf("abandoned and in-flight records: %w", err)
	}
	if err := checkFill(ctx, s.store, e.run, n); err != nil {
		return err
	}
	g := idempotency.New(s.store, idempotency.Options{Retention: retention})

	// New operations and replays, their runs interleaved as the default
	// rows' are.
	ops := []struct {
		name    string
		prepare prepareFunc
	}{
		{"new-operation", e.newOperation(g, "")},
		{"replay", e.replayOf(g, n)},
	}
	sums := make([]*summary, len(ops))
	for i, o := range ops {
		sums[i] = &summary{Name: o.name, Concurrency: cfg.concurrency}
	}
	progress := progressTo(log)
	before := func(what string) {
		if s.before != nil {
			s.before(what)
		}
	}
	err := interleave(len(ops), cfg.runs, func(i, run int) error {
		op, err := ops[i].prepare(ctx, fmt.Sprintf("%sn%d-%d-", e.run, col, run))
		if err != nil {
			return fmt.Errorf("%s: %w", ops[i].name, err)
		}
		before(fmt.Sprintf("%s run %d", ops[i].name, run+1))
		runtime.GC()
		label := fmt.Sprintf("%s %s, %s records", s.name, ops[i].name, countName(n))
		res := load(ctx, cfg.concurrency, warmOf(cfg), cfg.duration, op, e.use,
			func(d time.Duration, done uint64) { progress(label, run, cfg.runs, d, cfg.duration, done) })
		progress("", 0, 0, 0, 0, 0)
		sums[i].Runs = append(sums[i].Runs, &res)
		return ctx.Err()
	})
	if err != nil {
		return err
	}
	var steal, others []float64
	for _, sum := range sums {
		for _, r := range sum.Runs {
			steal, others = append(steal, r.Steal), append(others, r.Others)
		}
	}
	// Others counts PostgreSQL's own CPU in its rows: not a neighbour there.
	if st, ot := spreadOf(steal).Max, spreadOf(others).Max; st > 0.1 || s.name == "redis" && ot > 0.1 {
		t.note("%s records: the machine was not quiet: the hypervisor took up to %.2f of a core (steal), other processes used up to %.2f", countName(n), st, ot)
	}
	for _, sum := range sums {
		t.set(sum.Name+" ops/s", 0, col, sum.ops().Median)
		t.set(sum.Name+" p50 µs", 0, col, sum.of(quantile(0.5)).Median)
		t.set(sum.Name+" p99 µs", 0, col, sum.of(quantile(0.99)).Median)
		if failed, first := sum.errors(); failed > 0 {
			t.note("%s, %s records: %d operations FAILED, the first with: %v", sum.Name, countName(n), failed, first)
		}
	}

	var st idempotency.Stats
	before("Stats")
	d, err := medianCall(scaleCalls, func() (err error) { st, err = s.stats(ctx); return err })
	if err != nil {
		return fmt.Errorf("Stats: %w", err)
	}
	t.set("Stats ms", 2, col, d)
	if st.InFlight != scaleUnsettled || st.Abandoned != scaleUnsettled {
		t.note("%s records: Stats read %d in flight and %d abandoned, want %d and %d", countName(n), st.InFlight, st.Abandoned, scaleUnsettled, scaleUnsettled)
	}

	var listed []idempotency.AbandonedRecord
	before("ListAbandoned")
	d, err = medianCall(scaleCalls, func() (err error) { listed, err = s.store.ListAbandoned(ctx, scaleListed); return err })
	if err != nil {
		return fmt.Errorf("ListAbandoned: %w", err)
	}
	t.set(fmt.Sprintf("ListAbandoned(%d) ms", scaleListed), 2, col, d)
	if len(listed) != scaleListed {
		t.note("%s records: ListAbandoned(%d) listed %d", countName(n), scaleListed, len(listed))
	}

	sweeper := idempotency.New(s.store, idempotency.Options{Retention: retention,
		Recover: func(context.Context) (idempotency.Response, error) { return scaleResponse, nil }})
	var settled []int
	before("Sweep")
	d, err = medianCall(scaleSweeps, func() error {
		n, err := sweeper.Sweep(ctx, scaleListed)
		settled = append(settled, n)
		return err
	})
	if err != nil {
		return fmt.Errorf("Sweep: %w", err)
	}
	t.set(fmt.Sprintf("Sweep(%d) ms", scaleListed), 1, col, d)
	for _, got := range settled {
		if got != scaleListed {
			t.note("%s records: sweeps settled %v records, want %d each", countName(n), settled, scaleListed)
			break
		}
	}
	return nil
}

func warmOf(cfg config) time.Duration {
	return min(max(cfg.duration/10, 50*time.Millisecond), 500*time.Millisecond)
}

// replayOf replays completed records: on an empty store the default rows'
// (replayKeys records made by the row itself), otherwise one of the n
// filled records chosen at random by every operation.
func (e *env) replayOf(g *idempotency.Guard, n int) prepareFunc {
	if n == 0 {
		return e.replay(g, "")
	}
	return func(context.Context, string) (timedOp, error) {
		return timed(func(ctx context.Context, _, _ int) error {
			r, err := g.Do(ctx, scaleKey(e.run, rand.IntN(n)), fp, create)
			if err == nil && !r.Replayed {
				err = errors.New("a completed key ran again")
			}
			return err
		}), nil
	}
}

// medianCall calls f calls times in sequence and returns the median time
// of one call, in milliseconds, or f's first error.
func medianCall(calls int, f func() error) (float64, error) {
	ms := make([]float64, calls)
	for i := range ms {
		start := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		ms[i] = float64(time.Since(start).Microseconds()) / 1e3
	}
	return spreadOf(ms).Median, nil
}

// makeUnsettled claims scaleUnsettled records that stay in flight under an
// hour's lease, and as many that it abandons (Store.Abandon): the lease of
// each ends at once, so that it counts as abandoned and a sweep settles it.
func (e *env) makeUnsettled(ctx context.Context, s idempotency.Store) error {
	return each(ctx, 2*scaleUnsettled, e.concurrency, func(ctx context.Context, i int) error {
		name := e.run + "f" + strconv.Itoa(i)
		if i%2 == 0 {
			name = e.run + "a" + strconv.Itoa(i)
		}
		k := idempotency.Key{Scope: scaleScopes[i%len(scaleScopes)], Name: name}
		c, err := s.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_" + name,
			Lease: time.Hour, Retention: retention})
		switch {
		case err != nil:
			return err
		case c.State != idempotency.Owner:
			return fmt.Errorf("claim of the fresh key %s: state %d", k.Name, c.State)
		case i%2 == 0:
			return s.Abandon(ctx, k, c.Token)
		}
		return nil
	})
}

// checkFill claims 100 of the n filled records at random through the store
// itself: each must read as completed, with the fill's response. It checks
// that the fill wrote the store's layout.
func checkFill(ctx context.Context, s idempotency.Store, run string, n int) error {
	for range min(n, 100) {
		i := rand.IntN(n)
		k := scaleKey(run, i)
		c, err := s.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_check",
			Lease: time.Minute, Retention: retention})
		switch {
		case err != nil:
			return fmt.Errorf("checking the fill: record %d: %w", i, err)
		case c.State != idempotency.Completed:
			return fmt.Errorf("checking the fill: record %d reads as claim state %d, not completed", i, c.State)
		case c.OperationID != scaleOperationID(i) || c.Response.Status != scaleResponse.Status ||
			c.Response.Header.Get("Content-Type") != "application/json" || !bytes.Equal(c.Response.Body, scaleResponse.Body):
			return fmt.Errorf("checking the fill: record %d reads as operation %q, %d %v %q", i, c.OperationID,
				c.Response.Status, c.Response.Header, c.Response.Body)
		}
	}
	return nil
}

// Redis.

// scaleRedis measures the Redis store at every count, each on a store of
// its own: on a server the bench started, emptied first; on one given with
// -redis, under a prefix of the count's own, whose keys are deleted
// afterwards.
func (e *env) scaleRedis(ctx context.Context, cfg config, log io.Writer) (*scaleTable, error) {
	t := newScaleTable(fmt.Sprintf("Redis %s (RedisStore, standalone):", e.redisVersion), cfg.scale)
	for col, n := range cfg.scale {
		if err := e.scaleRedisAt(ctx, cfg, t, col, n, log); err != nil {
			return nil, fmt.Errorf("%s records: %w", countName(n), err)
		}
	}
	if e.throwaway {
		// Freed in the background: nothing is measured after it.
		if err := e.redis.FlushAllAsync(ctx).Err(); err != nil {
			return nil, err
		}
	}
	t.note("fill: SET of each record's key and value, as the store's scripts lay them out, in pipelines of %d; the %d abandoned and %d in-flight records through the store (Claim, Abandon)",
		redisPipeline, scaleUnsettled, scaleUnsettled)
	t.note("rehash after fill: the time until Redis had resized the hash tables of its keys and expiries, driven by reads (EXISTS) of the filled records; idle, it resizes for 1ms in every 100")
	t.note("bytes per record: INFO memory used_memory after the fill less before it, over N (the records' keys, values, expiries and the keyspace's hash tables)")
	t.note("replay: Guard.Do on one of the N records chosen at random; at 0, on %d records made before the run", replayKeys)
	t.note("Sweep: Guard.Sweep(%d) with a Recover that returns a response: ListAbandoned, then claim and complete each record listed", scaleListed)
	if !e.throwaway {
		t.note("WARNING: a server given with -redis: other clients' writes move used_memory too")
	}
	return t, nil
}

func (e *env) scaleRedisAt(ctx context.Context, cfg config, t *scaleTable, col, n int, log io.Writer) (err error) {
	if e.throwaway {
		// Synchronous, so that used_memory is settled before the fill; it
		// takes seconds after millions of records, longer than the
		// client's ReadTimeout, which a deadline on the call replaces.
		fctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		err := e.redis.FlushAll(fctx).Err()
		cancel()
		if err != nil {
			return fmt.Errorf("FLUSHALL: %w", err)
		}
	}
	// As long as the default prefix (idem:), and the count's own.
	var p [2]byte
	_, _ = crand.Read(p[:])
	prefix := fmt.Sprintf("%04x:", p)
	if !e.throwaway {
		defer func() { err = errors.Join(err, e.unlinkPrefix(context.WithoutCancel(ctx), prefix)) }()
	}
	s, err := idempotency.NewRedisStore(e.redis, idempotency.RedisOptions{Prefix: prefix, Replicas: cfg.replicas})
	if err != nil {
		return err
	}
	defer s.Close()

	before, err := e.usedMemory(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(log, "redis, %s records: filling ...\n", countName(n))
	start := time.Now()
	if err := e.fillRedis(ctx, prefix, n, log); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	took := time.Since(start)
	after, err := e.usedMemory(ctx)
	if err != nil {
		return err
	}
	// Set at 0 too, as not measured, so that the rows come first.
	fillS, perRecord := math.NaN(), math.NaN()
	if n > 0 {
		fmt.Fprintf(log, "redis, %s records: filled in %.1fs (%.0f records/s)\n", countName(n), took.Seconds(), float64(n)/took.Seconds())
		fillS, perRecord = took.Seconds(), float64(after-before)/float64(n)
	}
	t.set("fill s", 1, col, fillS)
	t.set("bytes per record", 0, col, perRecord)

	// A fill that doubled the keyspace leaves Redis resizing its hash
	// tables incrementally: a step with every lookup, and when idle 1ms
	// in every 100, which at 10M keys takes many minutes; every lookup
	// meanwhile probes two tables. The figures are of the steady state
	// after it, which reads of the filled records reach as traffic would,
	// and say when one ran during them.
	start = time.Now()
	for announced := false; ; {
		busy, known, err := e.redisRehashing(ctx)
		if err != nil {
			return err
		}
		if !known || !busy || time.Since(start) > rehashWait {
			if busy {
				t.note("%s records: the keyspace was still being rehashed after %v", countName(n), rehashWait)
			}
			break
		}
		if !announced {
			fmt.Fprintf(log, "redis, %s records: reading records until the keyspace's rehash ends ...\n", countName(n))
			announced = true
		}
		if err := e.readRecords(ctx, prefix, n); err != nil {
			return err
		}
	}
	t.set("rehash after fill s", 1, col, time.Since(start).Seconds())
	var rehashing []string
	st := scaleStore{name: "redis", store: s, stats: s.Stats, before: func(what string) {
		if busy, _, err := e.redisRehashing(ctx); err == nil && busy {
			rehashing = append(rehashing, what)
		}
	}}
	err = e.measureScale(ctx, cfg, t, col, n, st, log)
	if len(rehashing) > 0 {
		t.note("%s records: Redis was rehashing its keyspace (a power of two of keys passed) as these began: %s",
			countName(n), strings.Join(rehashing, ", "))
	}
	return err
}

// field returns the value of name in a reply that maps names to values: a
// map in RESP3, a flat array of names and values in RESP2.
func field(reply any, name string) (any, bool) {
	switch r := reply.(type) {
	case map[any]any:
		v, ok := r[name]
		return v, ok
	case []any:
		for i := 0; i+1 < len(r); i += 2 {
			if r[i] == name {
				return r[i+1], true
			}
		}
	}
	return nil, false
}

// readRecords reads, with EXISTS, 40,000 filled records chosen at random,
// in pipelines on 4 connections: each read moves an ongoing rehash of the
// keys and of the expiries a step.
func (e *env) readRecords(ctx context.Context, prefix string, n int) error {
	return each(ctx, 4, 4, func(ctx context.Context, _ int) error {
		_, err := e.redis.Pipelined(ctx, func(p redis.Pipeliner) error {
			for range 10_000 {
				p.Exists(ctx, redisRecordKey(prefix, scaleKey(e.run, rand.IntN(max(n, 1)))))
			}
			return nil
		})
		return err
	})
}

// rehashWait bounds the wait for the rehash a fill sets off.
const rehashWait = 5 * time.Minute

// redisRehashing reports whether Redis is resizing the hash table of db 0's
// keys or expiries. MEMORY STATS gives each table's overhead, which counts
// its slots, a power of two but while rehashing; known is false where that
// accounting is not Redis 6 or 7.0's.
func (e *env) redisRehashing(ctx context.Context) (busy, known bool, err error) {
	if !strings.HasPrefix(e.redisVersion, "6.") && !strings.HasPrefix(e.redisVersion, "7.0.") {
		return false, false, nil
	}
	c := e.info
	if c == nil {
		c = e.redis
	}
	stats, err := c.Do(ctx, "MEMORY", "STATS").Result()
	if err != nil {
		return false, false, fmt.Errorf("MEMORY STATS: %w", err)
	}
	info, err := c.Info(ctx, "keyspace").Result()
	if err != nil {
		return false, false, fmt.Errorf("INFO keyspace: %w", err)
	}
	var keys, expires int64
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "db0:"); ok {
			_, _ = fmt.Sscanf(v, "keys=%d,expires=%d", &keys, &expires)
		}
	}
	var main, exp int64 = -1, -1
	db, _ := field(stats, "db.0")
	if v, ok := field(db, "overhead.hashtable.main"); ok {
		main, _ = v.(int64)
	}
	if v, ok := field(db, "overhead.hashtable.expires"); ok {
		exp, _ = v.(int64)
	}
	if main < 0 || exp < 0 {
		return false, keys == 0, nil // no db 0: nothing to rehash
	}
	// Per key: a dictEntry (24 bytes) and its robj (16); per expiry, a
	// dictEntry; per slot, a pointer.
	slots, eslots := main-40*keys, exp-24*expires
	if slots < 0 || eslots < 0 || slots%8 != 0 || eslots%8 != 0 {
		return false, false, nil
	}
	pow2 := func(n int64) bool { return n&(n-1) == 0 }
	return !pow2(slots/8) || !pow2(eslots/8), true, nil
}

// fillRedis writes n completed records under prefix, each as complete.lua
// leaves one: the record's key holds its value, with the retention as its
// expiry, and no entry in its bucket's in-flight index.
func (e *env) fillRedis(ctx context.Context, prefix string, n int, log io.Writer) error {
	pipelines := (n + redisPipeline - 1) / redisPipeline
	var done atomic.Int64
	return each(ctx, pipelines, min(8, e.concurrency), func(ctx context.Context, p int) error {
		first, end := p*redisPipeline, min(n, (p+1)*redisPipeline)
		_, err := e.redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i := first; i < end; i++ {
				pipe.Set(ctx, redisRecordKey(prefix, scaleKey(e.run, i)), redisCompleted(scaleOperationID(i), scaleStored), retention)
			}
			return nil
		})
		if d := done.Add(int64(end - first)); err == nil && d%1_000_000 == 0 && d < int64(n) {
			fmt.Fprintf(log, "redis, %s records: %d written\n", countName(n), d)
		}
		return err
	})
}

// redisRecordKey is the key of k's record in a RedisStore of prefix, as
// RedisStore.recordKey spells it: the prefix, the hash tag of one of 1024
// buckets chosen by FNV-1a of the scope and the name, and the scope,
// length-prefixed, and the name.
func redisRecordKey(prefix string, k idempotency.Key) string {
	const buckets = 1024
	h := uint32(2166136261)
	for _, part := range [2]string{k.Scope, k.Name} {
		for i := 0; i < len(part); i++ {
			h = (h ^ uint32(part[i])) * 16777619
		}
		h *= 16777619
	}
	return prefix + "{" + strconv.FormatUint(uint64(h%buckets), 10) + "}:" +
		strconv.Itoa(len(k.Scope)) + ":" + k.Scope + ":" + k.Name
}

// redisCompleted is the value of a completed record (lua/record.lua): 'c',
// the fingerprint, the operation ID's length in a byte and the operation
// ID, then the stored response.
func redisCompleted(operationID string, stored []byte) string {
	b := make([]byte, 0, 2+len(fp)+len(operationID)+len(stored))
	b = append(b, 'c')
	b = append(b, fp[:]...)
	b = append(b, byte(len(operationID)))
	b = append(b, operationID...)
	return string(append(b, stored...))
}

// usedMemory reads used_memory from INFO memory.
func (e *env) usedMemory(ctx context.Context) (int64, error) {
	c := e.info
	if c == nil {
		c = e.redis
	}
	info, err := c.Info(ctx, "memory").Result()
	if err != nil {
		return 0, fmt.Errorf("INFO memory: %w", err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			return strconv.ParseInt(v, 10, 64)
		}
	}
	return 0, errors.New("INFO memory: no used_memory")
}

// unlinkPrefix deletes every key under prefix.
func (e *env) unlinkPrefix(ctx context.Context, prefix string) error {
	it := e.redis.Scan(ctx, 0, prefix+"*", 10_000).Iterator()
	batch := make([]string, 0, redisPipeline)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := e.redis.Unlink(ctx, batch...).Err()
		batch = batch[:0]
		return err
	}
	for it.Next(ctx) {
		if batch = append(batch, it.Val()); len(batch) == cap(batch) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return errors.Join(it.Err(), flush())
}

// PostgreSQL.

// scalePostgres measures the PostgreSQL store at every count, on a table of
// its own in the schema scaleSchema, emptied before each count and dropped,
// with the schema, at the end.
func (e *env) scalePostgres(ctx context.Context, cfg config, log io.Writer) (t *scaleTable, err error) {
	pool := e.pgNaive.pool
	for _, sql := range []string{`DROP SCHEMA IF EXISTS ` + scaleSchema + ` CASCADE`, `CREATE SCHEMA ` + scaleSchema} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			return nil, err
		}
	}
	defer func() {
		_, derr := pool.Exec(context.WithoutCancel(ctx), `DROP SCHEMA IF EXISTS `+scaleSchema+` CASCADE`)
		err = errors.Join(err, derr)
	}()
	table := scaleSchema + ".idempotency_records"
	s := postgres.New(pool, postgres.Options{Table: table, Channel: scaleSchema + "_wake"})
	defer s.Close()
	if err := s.Migrate(ctx); err != nil {
		return nil, err
	}
	p := &pgScale{pool: pool, store: s, table: pgx.Identifier{scaleSchema, "idempotency_records"}.Sanitize()}
	if err := pool.QueryRow(ctx, `SELECT current_setting('shared_buffers'), current_setting('autovacuum')`).Scan(&p.sharedBuffers, &p.autovacuum); err != nil {
		return nil, err
	}

	t = newScaleTable(fmt.Sprintf("PostgreSQL %s (postgres.Store):", e.pgVersion), cfg.scale)
	for col, n := range cfg.scale {
		if err := e.scalePostgresAt(ctx, cfg, t, col, n, p, log); err != nil {
			return nil, fmt.Errorf("%s records: %w", countName(n), err)
		}
	}
	t.note("fill: INSERT … SELECT … FROM generate_series in chunks of %d rows, two at a time, then VACUUM ANALYZE (not at 0: an empty table's statistics would plan scans of the whole table as it grows); then the %d abandoned and %d in-flight records through the store (Claim, Abandon)",
		pgChunk, scaleUnsettled, scaleUnsettled)
	t.note("bytes per record: pg_total_relation_size of the table (heap, indexes, TOAST, free space and visibility maps) over N, after the fill's VACUUM ANALYZE")
	t.note("replay: Guard.Do on one of the N records chosen at random; at 0, on %d records made before the run", replayKeys)
	t.note("Sweep: Guard.Sweep(%d) with a Recover that returns a response: ListAbandoned, then claim and complete each record listed", scaleListed)
	t.note("DeleteExpired: after the sweeps, the oldest 10%% of the N records (the first filled) are expired by an UPDATE of expires_at and created_at to an hour ago, then VACUUM ANALYZE, so they are as records past their retention would be; new operations run for %v alone, then while DeleteExpired runs (the figures beside it count the operations that ended meanwhile; - when fewer than 100 did); then the next 10%% are expired likewise and DeleteExpired runs with nothing else running",
		p.alone(cfg))
	t.note("the rows up to Sweep run on the statistics of the fill's VACUUM ANALYZE, taken with no record in flight; the DeleteExpired rows on those of a later one that saw the records left in flight: new operations can differ between the two for that reason alone")
	t.note("the server's settings: shared_buffers %s, autovacuum %s, the rest as initdb leaves them (a server the bench starts has fsync off)", p.sharedBuffers, p.autovacuum)
	return t, nil
}

// pgScale is the scale mode's PostgreSQL store.
type pgScale struct {
	pool                      *pgxpool.Pool
	store                     *postgres.Store
	table                     string // quoted
	sharedBuffers, autovacuum string
}

// alone is how long new operations run without DeleteExpired.
func (p *pgScale) alone(cfg config) time.Duration { return max(3*time.Second, cfg.duration) }

func (e *env) scalePostgresAt(ctx context.Context, cfg config, t *scaleTable, col, n int, p *pgScale, log io.Writer) error {
	if _, err := p.pool.Exec(ctx, `TRUNCATE `+p.table); err != nil {
		return err
	}
	fmt.Fprintf(log, "postgres, %s records: filling ...\n", countName(n))
	start := time.Now()
	if err := e.fillPostgres(ctx, p, n, log); err != nil {
		return fmt.Errorf("fill: %w", err)
	}
	took := time.Since(start)
	// Not on the empty table: its statistics would say it holds no row,
	// and the plans made from them scan it whole as it grows under the
	// new operations, until autovacuum analyzes it. Unanalyzed, it is
	// planned as a new store's table is.
	vstart := time.Now()
	if n > 0 {
		if _, err := p.pool.Exec(ctx, `VACUUM ANALYZE `+p.table); err != nil {
			return err
		}
	}
	vacuum := time.Since(vstart)
	var total, heap, indexes int64
	err := p.pool.QueryRow(ctx, `SELECT pg_total_relation_size($1::text::regclass), pg_relation_size($1::text::regclass), pg_indexes_size($1::text::regclass)`, p.table).
		Scan(&total, &heap, &indexes)
	if err != nil {
		return err
	}
	// Set at 0 too, as not measured, so that the rows come first.
	fillS, vacuumS, perRecord := math.NaN(), math.NaN(), math.NaN()
	if n > 0 {
		fmt.Fprintf(log, "postgres, %s records: filled in %.1fs (%.0f records/s), VACUUM ANALYZE %.1fs\n",
			countName(n), took.Seconds(), float64(n)/took.Seconds(), vacuum.Seconds())
		fillS, vacuumS, perRecord = took.Seconds(), vacuum.Seconds(), float64(total)/float64(n)
		t.note("%s records: the table takes %d MB: heap %.0f and indexes %.0f bytes per record",
			countName(n), total>>20, float64(heap)/float64(n), float64(indexes)/float64(n))
	}
	t.set("fill s", 1, col, fillS)
	t.set("VACUUM ANALYZE s", 1, col, vacuumS)
	t.set("bytes per record", 0, col, perRecord)
	if err := e.measureScale(ctx, cfg, t, col, n, scaleStore{name: "postgres", store: p.store, stats: p.store.Stats}, log); err != nil {
		return err
	}
	return e.deleteBeside(ctx, cfg, t, col, n, p, log)
}

// fillPostgres inserts n completed records, as Store.Complete leaves one,
// with the token drawn from the table's own sequence.
func (e *env) fillPostgres(ctx context.Context, p *pgScale, n int, log io.Writer) error {
	sql := `INSERT INTO ` + p.table + ` (scope, key, fingerprint, state, attempt, operation_id, lease_until, response, created_at, expires_at)
		SELECT ($1::text[])[g % ` + strconv.Itoa(len(scaleScopes)) + ` + 1], $2 || g, $3, 'completed', 1, 'op_' || substr(md5(g::text), 1, 26),
			now() + interval '10 seconds', $4, now(), now() + $5 * interval '1 microsecond'
		FROM generate_series($6::bigint, $7::bigint) g`
	chunks := (n + pgChunk - 1) / pgChunk
	var done atomic.Int64
	return each(ctx, chunks, 2, func(ctx context.Context, c int) error {
		first, last := c*pgChunk, min(n, (c+1)*pgChunk)-1
		_, err := p.pool.Exec(ctx, sql, scaleScopes, e.run+"r", fp[:], scaleStored, retention.Microseconds(), first, last)
		if d := done.Add(int64(last - first + 1)); err == nil && d%1_000_000 == 0 && d < int64(n) {
			fmt.Fprintf(log, "postgres, %s records: %d inserted\n", countName(n), d)
		}
		return err
	})
}

// deleteBeside expires the oldest tenth of the n records, then runs new
// operations for a while alone, then while DeleteExpired deletes them.
func (e *env) deleteBeside(ctx context.Context, cfg config, t *scaleTable, col, n int, p *pgScale, log io.Writer) error {
	expired := n / 10
	if err := e.expire(ctx, p, 0, expired, n, log); err != nil {
		return err
	}

	g := idempotency.New(p.store, idempotency.Options{Retention: retention})
	newOp := e.newOperation(g, "")
	op, err := newOp(ctx, fmt.Sprintf("%sd%d-alone-", e.run, col))
	if err != nil {
		return err
	}
	runtime.GC()
	progress := progressTo(log)
	label := fmt.Sprintf("postgres new-operation without DeleteExpired, %s records", countName(n))
	alone := load(ctx, cfg.concurrency, warmOf(cfg), p.alone(cfg), op, e.use,
		func(d time.Duration, done uint64) { progress(label, 0, 1, d, p.alone(cfg), done) })
	progress("", 0, 0, 0, 0, 0)

	op, err = newOp(ctx, fmt.Sprintf("%sd%d-beside-", e.run, col))
	if err != nil {
		return err
	}
	runtime.GC()
	fmt.Fprintf(log, "postgres, %s records: DeleteExpired beside new operations ...\n", countName(n))
	var deleted int64
	beside, took, err := loadBeside(ctx, cfg.concurrency, warmOf(cfg), op, func(ctx context.Context) (err error) {
		deleted, err = p.store.DeleteExpired(ctx)
		return err
	})
	if err != nil {
		return fmt.Errorf("DeleteExpired: %w", err)
	}

	enough := func(r *result, q float64) float64 {
		if r.Ops < 100 {
			return math.NaN()
		}
		return r.Latency.quantile(q)
	}
	opsPerSec := func(r *result) float64 {
		if r.Ops < 100 {
			return math.NaN()
		}
		return r.OpsPerSec()
	}
	t.set("new-operation ops/s, no DeleteExpired", 0, col, alone.OpsPerSec())
	t.set("new-operation ops/s, beside DeleteExpired", 0, col, opsPerSec(&beside))
	t.set("new-operation p99 µs, no DeleteExpired", 0, col, alone.Latency.quantile(0.99))
	t.set("new-operation p99 µs, beside DeleteExpired", 0, col, enough(&beside, 0.99))
	t.set("new-operation max µs, beside DeleteExpired", 0, col, enough(&beside, 1))
	t.set("DeleteExpired ms, beside new operations", 1, col, float64(took.Microseconds())/1e3)
	t.set("DeleteExpired rows", 0, col, float64(deleted))
	if deleted != int64(expired) {
		t.note("%s records: DeleteExpired deleted %d rows, want %d", countName(n), deleted, expired)
	}

	// The next tenth, with nothing else running.
	if err := e.expire(ctx, p, expired, 2*expired, n, log); err != nil {
		return err
	}
	start := time.Now()
	deleted, err = p.store.DeleteExpired(ctx)
	if err != nil {
		return fmt.Errorf("DeleteExpired: %w", err)
	}
	t.set("DeleteExpired ms, no traffic", 1, col, float64(time.Since(start).Microseconds())/1e3)
	if deleted != int64(expired) {
		t.note("%s records: DeleteExpired with no traffic deleted %d rows, want %d", countName(n), deleted, expired)
	}
	t.note("%s records: %d new operations ended while DeleteExpired ran", countName(n), beside.Ops)
	for _, r := range []*result{&alone, &beside} {
		if r.Errors > 0 {
			t.note("%s records: %d new operations FAILED around DeleteExpired, the first with: %v", countName(n), r.Errors, r.FirstErr)
		}
	}
	return nil
}

// expire makes the filled records [from, to) of n expired an hour ago,
// then has VACUUM ANALYZE clean the rows the UPDATE left behind, so that
// they look like records whose retention ran out.
func (e *env) expire(ctx context.Context, p *pgScale, from, to, n int, log io.Writer) error {
	start := time.Now()
	_, err := p.pool.Exec(ctx, `UPDATE `+p.table+` t SET expires_at = now() - interval '1 hour', created_at = now() - interval '1 hour'
		FROM (SELECT ($1::text[])[g % `+strconv.Itoa(len(scaleScopes))+` + 1] AS scope, $2 || g AS key
			FROM generate_series($3::bigint, $4::bigint - 1) g) old
		WHERE t.scope = old.scope AND t.key = old.key`, scaleScopes, e.run+"r", from, to)
	if err != nil {
		return fmt.Errorf("expiring: %w", err)
	}
	if _, err := p.pool.Exec(ctx, `VACUUM ANALYZE `+p.table); err != nil {
		return err
	}
	if to > from {
		fmt.Fprintf(log, "postgres, %s records: expired %d and vacuumed in %.1fs\n", countName(n), to-from, time.Since(start).Seconds())
	}
	return nil
}

// loadBeside runs op on concurrency goroutines, as load does: for warm,
// then while job runs, recording every operation that ends meanwhile. It
// returns what it recorded, how long job took, and job's error.
func loadBeside(ctx context.Context, concurrency int, warm time.Duration, op timedOp, job func(context.Context) error) (result, time.Duration, error) {
	c := startCrew(ctx, concurrency, op)
	sleep(ctx, warm)
	c.measuring.Store(true)
	start := time.Now()
	err := job(ctx)
	took := time.Since(start)
	return c.finish(took), took, err
}
