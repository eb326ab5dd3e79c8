// Command bench measures the idempotency library against bare Redis round
// trips, on one server with one client configuration, and checks the
// performance budgets.
//
//	go run ./bench                      # throwaway redis-server (and PostgreSQL)
//	go run ./bench -redis 10.0.0.5:6379 -postgres postgres://...
//	go run ./bench -cluster 10.0.0.5:7000,10.0.0.6:7000 -json
//
// Without -redis or -cluster it starts a redis-server on a free loopback
// port, or, when none is installed, an embedded miniredis whose figures say
// nothing about production. Without -postgres it starts a PostgreSQL when
// initdb and pg_ctl are installed, and skips the PostgreSQL rows otherwise.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"regexp"
	"runtime"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testserver"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
	"github.com/idempotency-go/idempotency/postgres"
)

type config struct {
	redisAddr   string
	cluster     string
	postgresDSN string
	duration    time.Duration
	concurrency int
	json        bool
	rows        *regexp.Regexp
	cpuprofile  string
	replicas    int
}

func main() {
	var cfg config
	var rows string
	flag.StringVar(&cfg.redisAddr, "redis", "", "Redis `HOST:PORT` (default: start a throwaway redis-server)")
	flag.StringVar(&cfg.cluster, "cluster", "", "Redis Cluster node addresses, `ADDR,...`")
	flag.StringVar(&cfg.postgresDSN, "postgres", "", "PostgreSQL `DSN` (default: start a throwaway server if installed)")
	flag.DurationVar(&cfg.duration, "duration", 3*time.Second, "measuring time per row")
	flag.IntVar(&cfg.concurrency, "concurrency", 50, "concurrent operations per row")
	flag.BoolVar(&cfg.json, "json", false, "print one JSON object per row on stdout; the rest goes to stderr")
	flag.StringVar(&rows, "rows", "", "run only the rows whose name matches this `regexp`")
	flag.StringVar(&cfg.cpuprofile, "cpuprofile", "", "write a CPU profile of the rows to `file`")
	flag.IntVar(&cfg.replicas, "replicas", 0, "RedisOptions.Replicas for the library's Redis rows: the `N` replicas of -redis or -cluster that confirm its writes")
	flag.Parse()
	var err error
	if cfg.rows, err = regexp.Compile(rows); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -rows:", err)
		os.Exit(2)
	}
	if cfg.concurrency < 1 || cfg.duration <= 0 {
		fmt.Fprintln(os.Stderr, "bench: -concurrency and -duration must be positive")
		os.Exit(2)
	}
	if cfg.replicas < 0 || cfg.replicas > 0 && cfg.redisAddr == "" && cfg.cluster == "" {
		fmt.Fprintln(os.Stderr, "bench: -replicas needs -redis or -cluster, with that many replicas per master")
		os.Exit(2)
	}
	// SIGPIPE too (go run ./bench | head): caught, it turns the next write
	// into an error and ends the run, which stops the servers it started;
	// uncaught, it would kill the process and leave them running.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGPIPE)
	err = run(ctx, cfg, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// env is what the rows run against.
type env struct {
	concurrency    int
	run            string // starts every key name, so that runs on one server never meet
	redis          redis.UniversalClient
	newRedisClient func(poolSize int) redis.UniversalClient // same settings as redis
	redisVersion   string
	embedded       bool   // miniredis in this process
	monitorAddr    string // a standalone redis-server, where MONITOR works; "" otherwise

	redisGuard, memGuard *idempotency.Guard
	slogGuard            *idempotency.Guard // redisGuard's store, logging every event
	otelGuard            *idempotency.Guard // redisGuard's store, with the OpenTelemetry observer
	pgGuard              *idempotency.Guard // nil without PostgreSQL
	pgSkip, pgVersion    string

	http    *http.Client
	httpURL string

	closers []func() error // run in reverse order
}

func (e *env) close() error {
	var errs []error
	for i := len(e.closers) - 1; i >= 0; i-- {
		errs = append(errs, e.closers[i]())
	}
	return errors.Join(errs...)
}

// setup connects to, or starts, the servers and builds the Guards.
func setup(ctx context.Context, cfg config, log io.Writer) (e *env, err error) {
	e = &env{concurrency: cfg.concurrency, run: strconv.FormatInt(time.Now().UnixNano(), 36) + "-"}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.close())
		}
	}()
	if err := e.setupRedis(ctx, cfg, log); err != nil {
		return e, err
	}
	e.setupPostgres(ctx, cfg)

	rs, err := idempotency.NewRedisStore(e.redis, idempotency.RedisOptions{Replicas: cfg.replicas})
	if err != nil {
		return e, err
	}
	e.closers = append(e.closers, rs.Close)
	e.redisGuard = idempotency.New(rs, idempotency.Options{})
	// Debug: every event is formatted and written, the most an observer
	// costs; at the default Info level replays and executions are skipped.
	debugLog := slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e.slogGuard = idempotency.New(rs, idempotency.Options{Observer: idempotency.SlogObserver(debugLog)})
	// The SDK's own providers, every span sampled, nothing exported: the
	// observer's cost, not an exporter's.
	obs, err := idempotencyotel.NewObserver(idempotencyotel.Options{
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader())),
		TracerProvider: sdktrace.NewTracerProvider(),
	})
	if err != nil {
		return e, err
	}
	e.otelGuard = idempotency.New(rs, idempotency.Options{Observer: obs})
	// Every new operation of the run must fit: a full memory store refuses.
	e.memGuard = idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{MaxRecords: 1 << 24}), idempotency.Options{})

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return e, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/bare", handle)
	mux.Handle("/guarded", e.redisGuard.Middleware(idempotency.MiddlewareOptions{})(http.HandlerFunc(handle)))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	e.closers = append(e.closers, srv.Close)
	e.httpURL = "http://" + l.Addr().String()
	tr := &http.Transport{MaxIdleConns: cfg.concurrency, MaxIdleConnsPerHost: cfg.concurrency, IdleConnTimeout: time.Minute}
	e.http = &http.Client{Transport: tr}
	e.closers = append(e.closers, func() error { tr.CloseIdleConnections(); return nil })
	return e, nil
}

func (e *env) setupRedis(ctx context.Context, cfg config, log io.Writer) error {
	if cfg.cluster != "" {
		addrs := strings.Split(cfg.cluster, ",")
		e.newRedisClient = func(n int) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, PoolSize: n})
		}
	} else {
		addr := cfg.redisAddr
		if addr == "" {
			srv, stop, err := testserver.LaunchRedis()
			if err == nil {
				e.closers = append(e.closers, stop)
				addr = srv.Addr
			} else {
				mr := miniredis.NewMiniRedis()
				if err := mr.Start(); err != nil {
					return err
				}
				e.closers = append(e.closers, func() error { mr.Close(); return nil })
				addr, e.embedded = mr.Addr(), true
				fmt.Fprintf(log, "WARNING: no redis-server (%s).\n"+
					"WARNING: measuring an embedded miniredis in this process: its figures say nothing about production.\n\n",
					oneLine(err))
			}
		}
		if !e.embedded {
			e.monitorAddr = addr
		}
		e.newRedisClient = func(n int) redis.UniversalClient {
			return redis.NewClient(&redis.Options{Addr: addr, PoolSize: n})
		}
	}
	// One pooled connection per concurrent operation, for every row.
	e.redis = e.newRedisClient(cfg.concurrency)
	e.closers = append(e.closers, e.redis.Close)
	if err := e.redis.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis: %w", err)
	}
	if e.embedded {
		e.redisVersion = "miniredis (embedded)"
		return nil
	}
	info, err := e.redis.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("redis: INFO: %w", err)
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			e.redisVersion = v
		}
	}
	if cfg.cluster != "" {
		e.redisVersion += " (cluster)"
	}
	return nil
}

// setupPostgres connects to, or starts, PostgreSQL; on failure the
// PostgreSQL rows are skipped, with pgSkip saying why.
func (e *env) setupPostgres(ctx context.Context, cfg config) {
	dsn := cfg.postgresDSN
	if dsn == "" {
		srv, stop, err := testserver.LaunchPostgres()
		if err != nil {
			e.pgSkip = "PostgreSQL not started: " + oneLine(err)
			return
		}
		e.closers = append(e.closers, stop)
		dsn = srv.DSN
	}
	err := func() error {
		pc, err := pgxpool.ParseConfig(dsn)
		if err != nil {
			return err
		}
		pc.MaxConns = int32(cfg.concurrency)
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			return err
		}
		e.closers = append(e.closers, func() error { pool.Close(); return nil })
		if err := pool.QueryRow(ctx, "SHOW server_version").Scan(&e.pgVersion); err != nil {
			return err
		}
		s := postgres.New(pool, postgres.Options{})
		e.closers = append(e.closers, func() error { s.Close(); return nil })
		if err := s.Migrate(ctx); err != nil {
			return err
		}
		e.pgGuard = idempotency.New(s, idempotency.Options{})
		return nil
	}()
	if err != nil {
		e.pgSkip = "PostgreSQL not usable: " + oneLine(err)
	}
}

// oneLine shortens an error, which may carry a server's log, for a note.
func oneLine(err error) string {
	s := strings.Join(strings.Fields(err.Error()), " ")
	if r := []rune(s); len(r) > 200 {
		s = string(r[:200]) + "…"
	}
	return s
}

// report is everything one run measured.
type report struct {
	results  []*result
	commands map[string]int // sent by one waiting request
	cmdsSkip string
	memory   []recordMemory
	memSkip  string
	gzip     []compression
	gzipBody int
}

func run(ctx context.Context, cfg config, stdout, stderr io.Writer) (err error) {
	e, err := setup(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, e.close()) }()

	var rep report
	// Before the rows: finding the record scans the whole keyspace.
	if e.embedded {
		rep.memSkip = "miniredis does not measure memory as Redis does"
	} else {
		for _, size := range []int{200, 10 << 10} {
			m, err := e.recordMemory(ctx, size)
			if err != nil {
				return fmt.Errorf("memory of a %d-byte record: %w", size, err)
			}
			rep.memory = append(rep.memory, m)
		}
	}
	body := jsonBody(10 << 10)
	rep.gzipBody = len(body)
	if rep.gzip, err = gzipCost(body); err != nil {
		return err
	}

	if cfg.cpuprofile != "" {
		f, err := os.Create(cfg.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	progress := progressTo(stderr)
	for _, r := range e.rows() {
		if !cfg.rows.MatchString(r.name) {
			continue
		}
		res, err := e.runRow(ctx, cfg, r, progress)
		if err != nil {
			return err
		}
		rep.results = append(rep.results, res)
	}
	if e.monitorAddr == "" {
		rep.cmdsSkip = "needs MONITOR on one redis-server"
	} else if cfg.rows.MatchString("redis/wake-up") {
		if rep.commands, err = e.waiterCommands(ctx); err != nil {
			return fmt.Errorf("counting a waiter's commands: %w", err)
		}
	}

	if cfg.json {
		if err := writeJSON(stdout, rep.results); err != nil {
			return err
		}
		stdout = stderr
	} else {
		writeTable(stdout, rep.results)
	}
	writeReport(stdout, e, cfg, &rep)
	return nil
}

func (e *env) runRow(ctx context.Context, cfg config, r row, progress func(string, time.Duration, time.Duration, uint64)) (*result, error) {
	op, err := r.prepare(ctx)
	var skip skipped
	if errors.As(err, &skip) {
		return &result{Name: r.name, Skipped: string(skip)}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", r.name, err)
	}
	n := cfg.concurrency
	if r.concurrency > 0 {
		n = r.concurrency
	}
	warm := min(max(cfg.duration/10, 50*time.Millisecond), 500*time.Millisecond)
	res := load(ctx, n, warm, cfg.duration, op, e.cpu, func(d time.Duration, ops uint64) { progress(r.name, d, cfg.duration, ops) })
	progress("", 0, 0, 0)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	res.Name, res.Baseline, res.Footnote = r.name, r.baseline, r.footnote
	return &res, nil
}

// cpu is the rows' cpuMeter: the server's time comes from INFO cpu on a
// standalone redis-server, and is not known elsewhere.
func (e *env) cpu() (self, server time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	server = -1
	if e.monitorAddr == "" {
		return self, server
	}
	info, err := e.redis.Info(context.Background(), "cpu").Result()
	if err != nil {
		return self, server
	}
	var secs float64
	for line := range strings.Lines(info) {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		if k == "used_cpu_sys" || k == "used_cpu_user" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return self, server
			}
			secs += f
		}
	}
	return self, time.Duration(secs * float64(time.Second))
}

// progressTo returns a reporter that rewrites one status line on a terminal
// and prints each row's name once elsewhere; an empty name ends the row.
func progressTo(w io.Writer) func(name string, done, total time.Duration, ops uint64) {
	f, ok := w.(*os.File)
	tty := false
	if ok {
		if fi, err := f.Stat(); err == nil {
			tty = fi.Mode()&os.ModeCharDevice != 0
		}
	}
	last := ""
	return func(name string, done, total time.Duration, ops uint64) {
		switch {
		case tty && name == "":
			fmt.Fprint(w, "\r\033[K")
		case tty:
			fmt.Fprintf(w, "\r\033[K%-26s %4.1fs/%.0fs %9.0f ops/s", name, done.Seconds(), total.Seconds(), float64(ops)/done.Seconds())
		case name != "" && name != last:
			fmt.Fprintf(w, "running %s ...\n", name)
		}
		if name != "" {
			last = name
		}
	}
}

// writeJSON prints one object per row that ran.
func writeJSON(w io.Writer, results []*result) error {
	enc := json.NewEncoder(w)
	for _, r := range results {
		if r.Skipped != "" {
			continue
		}
		err := enc.Encode(struct {
			Name        string  `json:"name"`
			OpsPerSec   float64 `json:"ops_per_sec"`
			P50         float64 `json:"p50_us"`
			P99         float64 `json:"p99_us"`
			AllocsPerOp float64 `json:"allocs_per_op"`
		}{r.Name, round(r.OpsPerSec(), 0), round(r.Latency.quantile(0.5), 1), round(r.Latency.quantile(0.99), 1), round(r.Allocs, 1)})
		if err != nil {
			return err
		}
	}
	return nil
}

func round(v float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(v*p) / p
}

func writeTable(w io.Writer, results []*result) {
	byName := map[string]*result{}
	for _, r := range results {
		byName[r.Name] = r
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "name\tops/s\tp50 µs\tp99 µs\tallocs/op\tcpu µs/op\tredis µs/op\tvs baseline\t")
	var notes []string
	for _, r := range results {
		if r.Skipped != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t\n", r.Name)
			notes = append(notes, fmt.Sprintf("%s: skipped: %s", r.Name, r.Skipped))
			continue
		}
		ratio := ""
		if b := byName[r.Baseline]; b != nil && b.OpsPerSec() > 0 {
			ratio = fmt.Sprintf("%.2f × %s", r.OpsPerSec()/b.OpsPerSec(), strings.TrimPrefix(b.Name, "baseline/"))
		}
		server := "-"
		if !math.IsNaN(r.ServerCPU) && !strings.HasPrefix(r.Name, "postgres/") && !strings.HasPrefix(r.Name, "memory/") {
			server = fmt.Sprintf("%.1f", r.ServerCPU)
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%.0f\t%.0f\t%.1f\t%.1f\t%s\t%s\t\n", r.Name, r.OpsPerSec(),
			r.Latency.quantile(0.5), r.Latency.quantile(0.99), r.Allocs, r.CPU, server, ratio)
		if r.Footnote != "" {
			notes = append(notes, fmt.Sprintf("%s: %s", r.Name, r.Footnote))
		}
		if r.Errors > 0 {
			notes = append(notes, fmt.Sprintf("%s: %d operations FAILED, the first with: %v", r.Name, r.Errors, r.FirstErr))
		}
	}
	tw.Flush()
	notes = append(notes,
		"allocs/op, cpu µs/op: heap allocations and CPU time of this process per operation (the HTTP rows' include the HTTP server's)",
		"redis µs/op: redis-server's CPU time per operation (INFO cpu; a standalone redis-server only)")
	for _, n := range notes {
		fmt.Fprintln(w, "  "+n)
	}
}

func writeReport(w io.Writer, e *env, cfg config, rep *report) {
	fmt.Fprintln(w)
	switch {
	case rep.commands != nil:
		names := make([]string, 0, len(rep.commands))
		total := 0
		for name, n := range rep.commands {
			names = append(names, fmt.Sprintf("%s %d", name, n))
			total += n
		}
		sort.Strings(names)
		fmt.Fprintf(w, "A waiting request sent %d commands to Redis: %s\n  (not counting the owner's, the scripts' own calls, or connection handshakes)\n",
			total, strings.Join(names, ", "))
	case rep.cmdsSkip != "":
		fmt.Fprintf(w, "Commands of a waiting request: not counted (%s)\n", rep.cmdsSkip)
	}

	fmt.Fprintln(w, "\nRedis memory per completed record (MEMORY USAGE, Content-Type header and a JSON body):")
	if rep.memSkip != "" {
		fmt.Fprintf(w, "  not measured: %s\n", rep.memSkip)
	}
	for _, m := range rep.memory {
		fmt.Fprintf(w, "  %6d-byte body: %6d bytes, overhead %d bytes\n", m.Body, m.Usage, m.Overhead())
	}

	fmt.Fprintf(w, "\nCompressing a %d-byte JSON response body with gzip (one core, writer and reader reused):\n", rep.gzipBody)
	for _, c := range rep.gzip {
		fmt.Fprintf(w, "  %-18s %5d bytes (%2.0f %%), saves %5d bytes; %4.0f µs to compress, %3.0f µs to decompress\n",
			c.Name+":", c.Size, 100*float64(c.Size)/float64(rep.gzipBody), rep.gzipBody-c.Size,
			float64(c.Compress.Nanoseconds())/1e3, float64(c.Decompress.Nanoseconds())/1e3)
	}
	if r := find(rep.results, "redis/new-operation"); r != nil && len(rep.gzip) > 0 {
		cpu := float64(runtime.NumCPU()) * 1e6 / r.OpsPerSec()
		fmt.Fprintf(w, "  for scale: a redis/new-operation here costs about %.0f µs of CPU (%d cores / %.0f ops/s), server included\n",
			cpu, runtime.NumCPU(), r.OpsPerSec())
	}

	fmt.Fprintln(w, "\nBudgets:")
	for _, c := range budgets(rep) {
		fmt.Fprintf(w, "  %-4s  %-58s %s\n", c.verdict, c.what, c.got)
	}

	fmt.Fprintln(w, "\nMachine:")
	fmt.Fprintf(w, "  %s/%s, %d CPUs (GOMAXPROCS %d), %s\n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version())
	fmt.Fprintf(w, "  Redis %s, %d connections in the pool\n", e.redisVersion, cfg.concurrency)
	if cfg.replicas > 0 {
		fmt.Fprintf(w, "  the library's writes confirmed by %d replicas (RedisOptions.Replicas)\n", cfg.replicas)
	}
	if e.pgVersion != "" {
		fmt.Fprintf(w, "  PostgreSQL %s, %d connections in the pool\n", e.pgVersion, cfg.concurrency)
	} else {
		fmt.Fprintf(w, "  %s\n", e.pgSkip)
	}
	fmt.Fprintf(w, "  %v per row, %d concurrent operations; client and servers share this machine\n", cfg.duration, cfg.concurrency)
}

func find(results []*result, name string) *result {
	for _, r := range results {
		if r.Name == name && r.Skipped == "" && r.Ops > 0 {
			return r
		}
	}
	return nil
}

type check struct{ verdict, what, got string }

// budgets checks the library's performance budgets; a check whose inputs
// were not measured says n/a.
func budgets(rep *report) []check {
	verdict := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "MISS"
	}
	ratio := func(what, num, den string, want float64) check {
		a, b := find(rep.results, num), find(rep.results, den)
		if a == nil || b == nil {
			return check{"n/a", what, "not measured"}
		}
		got := a.OpsPerSec() / b.OpsPerSec()
		return check{verdict(got >= want), what, fmt.Sprintf("%.2f ×  (%.0f / %.0f ops/s)", got, a.OpsPerSec(), b.OpsPerSec())}
	}
	checks := []check{
		ratio("redis/new-operation ≥ 0.85 × baseline/two-roundtrips", "redis/new-operation", "baseline/two-roundtrips", 0.85),
		ratio("redis/replay ≥ 0.9 × baseline/one-roundtrip", "redis/replay", "baseline/one-roundtrip", 0.9),
	}
	const wake = "redis/wake-up p99 ≤ 2 ms"
	if r := find(rep.results, "redis/wake-up"); r != nil {
		p99 := r.Latency.quantile(0.99) / 1e3
		checks = append(checks, check{verdict(p99 <= 2), wake, fmt.Sprintf("%.2f ms", p99)})
	} else {
		checks = append(checks, check{"n/a", wake, "not measured"})
	}
	checks = append(checks, ratio("redis/new-operation ≥ 6 × postgres/new-operation", "redis/new-operation", "postgres/new-operation", 6))
	const mem = "Redis memory per 200-byte record ≤ body + 250 bytes"
	if len(rep.memory) > 0 {
		m := rep.memory[0]
		checks = append(checks, check{verdict(m.Overhead() <= 250), mem, fmt.Sprintf("body + %d bytes", m.Overhead())})
	} else {
		checks = append(checks, check{"n/a", mem, rep.memSkip})
	}
	return checks
}
