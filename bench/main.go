// Command bench measures the idempotency library against bare Redis round
// trips, on one server with one client configuration, and checks the
// performance budgets.
//
//	go run ./bench                      # throwaway redis-server (and PostgreSQL)
//	go run ./bench -redis 10.0.0.5:6379 -postgres postgres://...
//	go run ./bench -cluster 10.0.0.5:7000,10.0.0.6:7000 -json
//	go run ./bench -scale 1000000,10000000  # costs with 0, 1M and 10M records held
//
// Without -redis or -cluster it starts a redis-server on a free loopback
// port, or, when none is installed, an embedded miniredis whose figures say
// nothing about production. Without -postgres it starts a PostgreSQL when
// initdb and pg_ctl are installed, and skips the PostgreSQL rows otherwise.
//
// Every row runs -runs times for -duration, the rows' runs interleaved (run
// 1 of every row, then run 2, ...), and its figures are the medians over
// its runs; a ratio to a baseline, and so a budget, is taken run by run,
// each run against the baseline's run measured close to it, and its median
// reported with its range. A server the bench started is emptied before
// every run; a server given with -redis or -cluster never is.
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/maphash"
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
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/idempotency-go/idempotency/seal"
)

type config struct {
	redisAddr   string
	cluster     string
	postgresDSN string
	valkey      string        // a Valkey HOST:PORT with appendonly yes, for the durability rows
	duration    time.Duration // of one run of one row
	runs        int
	concurrency int
	json        bool
	rows        *regexp.Regexp
	cpuprofile  string
	replicas    int
	scale       []int // record counts of the scale mode (scale.go), 0 first; nil: the rows
	sizeRecords int   // records each PostgreSQL sizing averages over
}

func main() {
	var cfg config
	var rows string
	flag.StringVar(&cfg.redisAddr, "redis", "", "Redis `HOST:PORT` (default: start a throwaway redis-server)")
	flag.StringVar(&cfg.cluster, "cluster", "", "Redis Cluster node addresses, `ADDR,...`")
	flag.StringVar(&cfg.postgresDSN, "postgres", "", "PostgreSQL `DSN` (default: start a throwaway server if installed)")
	flag.StringVar(&cfg.valkey, "valkey", "", "a Valkey 8 `HOST:PORT` with appendonly yes and appendfsync always, for the durability rows (default: start a throwaway valkey-server, appendfsync always, if installed)")
	flag.DurationVar(&cfg.duration, "duration", time.Second, "measuring time of one run of one row")
	flag.IntVar(&cfg.runs, "runs", 3, "runs of every row, `N`: a row's figures are the medians over its runs")
	flag.IntVar(&cfg.concurrency, "concurrency", 50, "concurrent operations per row")
	flag.IntVar(&cfg.sizeRecords, "size-records", 5000, "records each PostgreSQL sizing averages over, `N`")
	flag.BoolVar(&cfg.json, "json", false, "print one JSON object per row on stdout; the rest goes to stderr")
	flag.StringVar(&rows, "rows", "", "run only the rows whose name matches this `regexp`")
	flag.StringVar(&cfg.cpuprofile, "cpuprofile", "", "write a CPU profile of the rows to `file`")
	flag.IntVar(&cfg.replicas, "replicas", 0, "RedisOptions.Replicas for the library's Redis rows: the `N` replicas of -redis or -cluster that confirm its writes")
	flag.Func("scale", "instead of the rows, measure each store holding each of these record `COUNTS,...` (and 0), e.g. 1M,10M; -rows then picks the stores (redis, postgres)",
		func(s string) (err error) { cfg.scale, err = parseScale(s); return err })
	flag.Parse()
	var err error
	if cfg.rows, err = regexp.Compile(rows); err != nil {
		fmt.Fprintln(os.Stderr, "bench: -rows:", err)
		os.Exit(2)
	}
	if cfg.concurrency < 1 || cfg.duration <= 0 || cfg.runs < 1 || cfg.sizeRecords < 1 {
		fmt.Fprintln(os.Stderr, "bench: -concurrency, -duration, -runs and -size-records must be positive")
		os.Exit(2)
	}
	if cfg.replicas < 0 || cfg.replicas > 0 && cfg.redisAddr == "" && cfg.cluster == "" {
		fmt.Fprintln(os.Stderr, "bench: -replicas needs -redis or -cluster, with that many replicas per master")
		os.Exit(2)
	}
	if cfg.scale != nil && (cfg.json || cfg.cluster != "") {
		fmt.Fprintln(os.Stderr, "bench: -scale prints tables (no -json), and measures a standalone Redis (no -cluster)")
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
	trips          tripCounter                              // counts redis's round trips
	info           redis.UniversalClient                    // INFO on a standalone redis-server, off redis's pool and trips
	newRedisClient func(poolSize int) redis.UniversalClient // same settings as redis
	redisVersion   string
	embedded       bool   // miniredis in this process
	monitorAddr    string // a standalone redis-server, where MONITOR works; "" otherwise
	// throwaway is set when the bench started the Redis server itself, and
	// may empty it between runs.
	throwaway bool
	seed      maphash.Seed // of the baselines' hash tags

	redisGuard        *idempotency.Guard
	slogGuard         *idempotency.Guard // redisGuard's store, logging every event
	otelGuard         *idempotency.Guard // redisGuard's store, with the OpenTelemetry observer
	sealedGuard       *idempotency.Guard // redisGuard's store, sealed (seal.Store)
	pgGuard           *idempotency.Guard // nil without PostgreSQL
	pgOneCommitGuard  *idempotency.Guard // pgGuard's table in the one-commit mode; nil without PostgreSQL
	pgNaive           *naive             // the PostgreSQL floors' table; nil without PostgreSQL
	pgSkip, pgVersion string

	valkeyGuard, fsyncGuard   *idempotency.Guard // nil without Valkey
	valkeySkip, valkeyVersion string

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
	e = &env{concurrency: cfg.concurrency, run: strconv.FormatInt(time.Now().UnixNano(), 36) + "-", seed: maphash.MakeSeed()}
	defer func() {
		if err != nil {
			err = errors.Join(err, e.close())
		}
	}()
	if err := e.setupRedis(ctx, cfg, log); err != nil {
		return e, err
	}
	e.setupPostgres(ctx, cfg)
	e.setupValkey(ctx, cfg)

	rs, err := idempotency.NewRedisStore(e.redis, idempotency.RedisOptions{Replicas: cfg.replicas})
	if err != nil {
		return e, err
	}
	e.closers = append(e.closers, rs.Close)
	e.redisGuard = idempotency.New(rs, idempotency.Options{Retention: retention})
	// Debug: every event is formatted and written, the most an observer
	// costs; at the default Info level replays and executions are skipped.
	debugLog := slog.New(slog.NewJSONHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelDebug}))
	e.slogGuard = idempotency.New(rs, idempotency.Options{Retention: retention, Observer: idempotency.SlogObserver(debugLog)})
	// The SDK's own providers, every span sampled, nothing exported: the
	// observer's cost, not an exporter's.
	obs, err := idempotencyotel.NewObserver(idempotencyotel.Options{
		MeterProvider:  sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader())),
		TracerProvider: sdktrace.NewTracerProvider(),
	})
	if err != nil {
		return e, err
	}
	e.otelGuard = idempotency.New(rs, idempotency.Options{Retention: retention, Observer: obs})
	sealed, err := seal.New(rs, seal.Keys{Current: benchKey()})
	if err != nil {
		return e, err
	}
	e.sealedGuard = idempotency.New(sealed, idempotency.Options{Retention: retention})

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return e, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/bare", handle)
	mux.Handle("/one", e.setNXHandler(1))
	mux.Handle("/two", e.setNXHandler(2))
	mux.Handle("/guarded", e.redisGuard.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(http.HandlerFunc(handle)))
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
	// Every client honours its calls' deadlines (ContextTimeoutEnabled), as
	// the README advises for the library; the baselines' calls carry none,
	// so the setting changes nothing for them.
	if cfg.cluster != "" {
		addrs := strings.Split(cfg.cluster, ",")
		e.newRedisClient = func(n int) redis.UniversalClient {
			return redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs, PoolSize: n, ContextTimeoutEnabled: true})
		}
	} else {
		addr := cfg.redisAddr
		if addr == "" {
			srv, stop, err := testserver.LaunchRedis()
			e.throwaway = true
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
			return redis.NewClient(&redis.Options{Addr: addr, PoolSize: n, ContextTimeoutEnabled: true})
		}
	}
	// One pooled connection per concurrent operation, for every row.
	e.redis = e.newRedisClient(cfg.concurrency)
	e.closers = append(e.closers, e.redis.Close)
	e.redis.AddHook(&e.trips)
	if e.monitorAddr != "" {
		e.info = e.newRedisClient(1)
		e.closers = append(e.closers, e.info.Close)
	}
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
		for _, table := range []string{naiveTable, indexedTable, hotTable} {
			if _, err := pool.Exec(ctx, table); err != nil {
				return err
			}
		}
		e.pgGuard = idempotency.New(s, idempotency.Options{Retention: retention})
		e.pgOneCommitGuard = idempotency.New(s.OneCommit(), idempotency.Options{Retention: retention})
		e.pgNaive = &naive{pool: pool}
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

// report is everything the program measured.
type report struct {
	rows      []*summary
	runs      int
	commands  map[string]int // sent by one waiting request
	cmdsSkip  string
	memory    []recordMemory
	memSkip   string
	pgBytes   []recordMemory // PostgreSQL's table, indexes included, per record
	pgSkip    string
	gzip      []compression
	gzipBody  int
	responses []responseSize // the corpus of responses.go, in its order
}

// row returns the named row if it ran, and did something, in every run.
func (rep *report) row(name string) *summary {
	for _, s := range rep.rows {
		if s.Name == name && s.measured() {
			return s
		}
	}
	return nil
}

func run(ctx context.Context, cfg config, stdout, stderr io.Writer) (err error) {
	e, err := setup(ctx, cfg, stderr)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, e.close()) }()
	if cfg.scale != nil {
		return e.runScale(ctx, cfg, stdout, stderr)
	}

	rep := report{runs: cfg.runs}
	// Before the rows: finding the record scans the whole keyspace.
	if e.embedded {
		rep.memSkip = "miniredis does not measure memory as Redis does"
	} else {
		// The budget's record first: a 200-byte body under a short key
		// name; then a UUID for a name, as clients often send, and a
		// larger body, plain and compressed.
		for _, r := range []struct{ size, name, compressAbove int }{{200, 6, 0}, {200, 36, 0}, {10 << 10, 6, 0}, {10 << 10, 6, 1024}} {
			m, err := e.recordMemory(ctx, jsonResponse(jsonBody(r.size)), r.name, r.compressAbove)
			if err != nil {
				return fmt.Errorf("memory of a %d-byte record: %w", r.size, err)
			}
			rep.memory = append(rep.memory, m)
		}
	}
	if e.pgNaive == nil {
		rep.pgSkip = e.pgSkip
	}
	for _, size := range []int{200, 10 << 10} {
		if e.pgNaive == nil {
			break
		}
		n, err := pgRecordBytes(ctx, e.pgNaive.pool, jsonResponse(jsonBody(size)), cfg.sizeRecords, e.concurrency)
		if err != nil {
			return fmt.Errorf("PostgreSQL bytes of a %d-byte record: %w", size, err)
		}
		rep.pgBytes = append(rep.pgBytes, recordMemory{Body: size, Name: 36, Usage: n})
	}
	if rep.responses, err = e.sizeResponses(ctx, cfg.sizeRecords); err != nil {
		return err
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
	var rows []row
	for _, r := range e.rows() {
		if cfg.rows.MatchString(r.name) {
			rows = append(rows, r)
			n := cmp.Or(r.concurrency, cfg.concurrency)
			rep.rows = append(rep.rows, &summary{Name: r.name, Baseline: r.baseline, Concurrency: n, Footnote: r.footnote})
		}
	}
	progress := progressTo(stderr)
	err = interleave(len(rows), cfg.runs, func(i, run int) error {
		s := rep.rows[i]
		if s.Skipped != "" {
			return nil
		}
		res, err := e.runRow(ctx, cfg, rows[i], s.Concurrency, fmt.Sprintf("%s%d-%d-", e.run, run, i),
			func(d time.Duration, ops uint64) { progress(s.Name, run, cfg.runs, d, cfg.duration, ops) })
		progress("", 0, 0, 0, 0, 0)
		var skip skipped
		switch {
		case errors.As(err, &skip):
			s.Skipped = string(skip)
		case err != nil:
			return fmt.Errorf("%s: %w", s.Name, err)
		default:
			s.Runs = append(s.Runs, res)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if e.monitorAddr == "" {
		rep.cmdsSkip = "needs MONITOR on one redis-server"
	} else if cfg.rows.MatchString("redis/wake-up") {
		if rep.commands, err = e.waiterCommands(ctx); err != nil {
			return fmt.Errorf("counting a waiter's commands: %w", err)
		}
	}

	if cfg.json {
		if err := writeJSON(stdout, &rep); err != nil {
			return err
		}
		stdout = stderr
	} else {
		writeTable(stdout, &rep)
	}
	writeReport(stdout, e, cfg, &rep)
	return nil
}

// runRow runs r once on n goroutines. On a server the bench started, each
// run starts on an empty keyspace, so that no run pays for the keys the
// runs before it left (a larger dict to rehash and walk, more memory); and
// every run starts on a collected heap, so that no run pays for collecting
// another's garbage.
func (e *env) runRow(ctx context.Context, cfg config, r row, n int, prefix string, progress func(time.Duration, uint64)) (*result, error) {
	if e.throwaway {
		if err := e.redis.FlushAll(ctx).Err(); err != nil {
			return nil, fmt.Errorf("FLUSHALL: %w", err)
		}
	}
	op, err := r.prepare(ctx, prefix)
	if err != nil {
		return nil, err
	}
	runtime.GC()
	warm := min(max(cfg.duration/10, 50*time.Millisecond), 500*time.Millisecond)
	res := load(ctx, n, warm, cfg.duration, op, e.use, progress)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return &res, nil
}

// use is the rows' meter. The server's CPU time (INFO cpu) and command
// counters (INFO commandstats) are read from a standalone redis-server,
// and are not known elsewhere; the hypervisor's steal is read wherever
// /proc/stat is, and the other processes' CPU time only when the bench
// started the server, the one server known to run here.
func (e *env) use() usage {
	u := usage{server: -1, others: -1, steal: -1, trips: e.trips.n.Load()}
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
		u.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if e.monitorAddr != "" {
		u.server, u.commands = e.serverUsage()
	}
	busy, steal, ok := machineCPU()
	if ok {
		u.steal = steal
	}
	// An embedded server's time is this process's.
	if ok && e.throwaway && (e.embedded || u.server >= 0) {
		u.others = busy - u.self - max(u.server, 0)
	}
	return u
}

// serverUsage reads redis-server's CPU time, or -1, and its command
// counters, or nil.
func (e *env) serverUsage() (time.Duration, map[string]commandStat) {
	ctx := context.Background()
	var cmds map[string]commandStat
	if info, err := e.info.Info(ctx, "commandstats").Result(); err == nil {
		cmds = parseCommandStats(info)
	}
	info, err := e.info.Info(ctx, "cpu").Result()
	if err != nil {
		return -1, cmds
	}
	var secs float64
	for line := range strings.Lines(info) {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		if k == "used_cpu_sys" || k == "used_cpu_user" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return -1, cmds
			}
			secs += f
		}
	}
	return time.Duration(secs * float64(time.Second)), cmds
}

// progressTo returns a reporter that rewrites one status line on a terminal
// and prints each run of a row once elsewhere; an empty name ends the run.
func progressTo(w io.Writer) func(name string, run, runs int, done, total time.Duration, ops uint64) {
	f, ok := w.(*os.File)
	tty := false
	if ok {
		if fi, err := f.Stat(); err == nil {
			tty = fi.Mode()&os.ModeCharDevice != 0
		}
	}
	last := ""
	return func(name string, run, runs int, done, total time.Duration, ops uint64) {
		at := fmt.Sprintf("%s, run %d/%d", name, run+1, runs)
		switch {
		case tty && name == "":
			fmt.Fprint(w, "\r\033[K")
		case tty:
			fmt.Fprintf(w, "\r\033[K%-40s %4.1fs/%.0fs %9.0f ops/s", at, done.Seconds(), total.Seconds(), float64(ops)/done.Seconds())
		case name != "" && at != last:
			fmt.Fprintf(w, "running %s ...\n", at)
		}
		if name != "" {
			last = at
		}
	}
}

// jsonRow is one row of -json. Figures are medians over the runs; _min and
// _max are the extremes of the same figure, and vs_baseline is the median
// of the run-by-run ratios. others_cpu is the CPU, in cores, that the
// machine's other processes used during a run (PostgreSQL's own too, in the
// postgres rows), and steal_cpu what the hypervisor took.
type jsonRow struct {
	Name         string               `json:"name"`
	OpsPerSec    float64              `json:"ops_per_sec"`
	P50          float64              `json:"p50_us"`
	P99          float64              `json:"p99_us"`
	AllocsPerOp  float64              `json:"allocs_per_op"`
	Concurrency  int                  `json:"concurrency"`
	Runs         int                  `json:"runs"`
	OpsPerSecMin float64              `json:"ops_per_sec_min"`
	OpsPerSecMax float64              `json:"ops_per_sec_max"`
	OpsPerSecRun []float64            `json:"ops_per_sec_runs"`
	CPU          float64              `json:"cpu_us_per_op"`
	ServerCPU    *float64             `json:"redis_us_per_op,omitempty"`
	Baseline     string               `json:"baseline,omitempty"`
	VsBaseline   *float64             `json:"vs_baseline,omitempty"`
	VsMin        *float64             `json:"vs_baseline_min,omitempty"`
	VsMax        *float64             `json:"vs_baseline_max,omitempty"`
	Others       *float64             `json:"others_cpu,omitempty"`
	OthersMax    *float64             `json:"others_cpu_max,omitempty"`
	Steal        *float64             `json:"steal_cpu,omitempty"`
	StealMax     *float64             `json:"steal_cpu_max,omitempty"`
	Errors       uint64               `json:"errors,omitempty"`
	RoundTrips   float64              `json:"redis_round_trips_per_op"`
	Commands     map[string]jsonPerOp `json:"redis_commands,omitempty"`
}

// jsonPerOp is one command's Δcalls / ops and Δusec / ops in INFO
// commandstats.
type jsonPerOp struct {
	Calls float64 `json:"calls_per_op"`
	Usec  float64 `json:"usec_per_op"`
}

// writeJSON prints one object per row that ran.
func writeJSON(w io.Writer, rep *report) error {
	enc := json.NewEncoder(w)
	for _, s := range rep.rows {
		if len(s.Runs) == 0 {
			continue
		}
		ops := s.ops()
		j := jsonRow{
			Name:         s.Name,
			OpsPerSec:    round(ops.Median, 0),
			P50:          round(s.of(quantile(0.5)).Median, 1),
			P99:          round(s.of(quantile(0.99)).Median, 1),
			AllocsPerOp:  round(s.of(allocs).Median, 1),
			Concurrency:  s.Concurrency,
			Runs:         len(s.Runs),
			OpsPerSecMin: round(ops.Min, 0),
			OpsPerSecMax: round(ops.Max, 0),
			CPU:          round(s.of(clientCPU).Median, 1),
		}
		if onRedisServer(s.Name) {
			j.ServerCPU = known(s.of(serverCPU).Median, 1)
		}
		j.RoundTrips = round(s.of(roundTrips).Median, 3)
		others, steal := s.of(othersCPU), s.of(stealCPU)
		j.Others, j.OthersMax = known(others.Median, 2), known(others.Max, 2)
		j.Steal, j.StealMax = known(steal.Median, 2), known(steal.Max, 2)
		for _, r := range s.Runs {
			j.OpsPerSecRun = append(j.OpsPerSecRun, round(r.OpsPerSec(), 0))
		}
		if b := rep.row(s.Baseline); b != nil {
			vs := s.ratio(b)
			j.Baseline, j.VsBaseline, j.VsMin, j.VsMax = b.Name, known(vs.Median, 3), known(vs.Min, 3), known(vs.Max, 3)
		}
		j.Errors, _ = s.errors()
		if cmds := s.commands(); cmds != nil {
			j.Commands = map[string]jsonPerOp{}
			for name, c := range cmds {
				j.Commands[name] = jsonPerOp{round(c.Calls, 3), round(c.Usec, 2)}
			}
		}
		if err := enc.Encode(j); err != nil {
			return err
		}
	}
	return nil
}

// The figures of one run that the table gives medians of.
func quantile(q float64) func(*result) float64 {
	return func(r *result) float64 { return r.Latency.quantile(q) }
}
func allocs(r *result) float64     { return r.Allocs }
func clientCPU(r *result) float64  { return r.CPU }
func serverCPU(r *result) float64  { return r.ServerCPU }
func roundTrips(r *result) float64 { return r.RoundTrips }
func othersCPU(r *result) float64  { return r.Others }
func stealCPU(r *result) float64   { return r.Steal }

// onRedisServer says whether a row runs on the redis-server whose CPU
// serverCPU reads.
func onRedisServer(name string) bool {
	return !onPostgres(name) && !onValkey(name) && !strings.HasPrefix(name, "memory/")
}

func round(v float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(v*p) / p
}

// known returns v rounded, or nil for NaN, which JSON cannot hold.
func known(v float64, digits int) *float64 {
	if math.IsNaN(v) {
		return nil
	}
	v = round(v, digits)
	return &v
}

func writeTable(w io.Writer, rep *report) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "name\tops/s\tmin/max %\tp50 µs\tp99 µs\tallocs/op\tcpu µs/op\tredis µs/op\tvs baseline (min–max)\t")
	var notes []string
	for _, s := range rep.rows {
		if len(s.Runs) == 0 {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t-\t\n", s.Name)
			if s.Skipped != "" {
				notes = append(notes, fmt.Sprintf("%s: skipped: %s", s.Name, s.Skipped))
			}
			continue
		}
		ratio := ""
		if b := rep.row(s.Baseline); b != nil {
			vs := s.ratio(b)
			ratio = fmt.Sprintf("%.2f × %s (%.2f–%.2f)", vs.Median, strings.TrimPrefix(b.Name, "baseline/"), vs.Min, vs.Max)
		}
		server := "-"
		if v := s.of(serverCPU).Median; !math.IsNaN(v) && onRedisServer(s.Name) {
			server = fmt.Sprintf("%.1f", v)
		}
		ops := s.ops()
		fmt.Fprintf(tw, "%s\t%.0f\t%s\t%.0f\t%.0f\t%.1f\t%.1f\t%s\t%s\t\n", s.Name, ops.Median, percents(ops),
			s.of(quantile(0.5)).Median, s.of(quantile(0.99)).Median, s.of(allocs).Median, s.of(clientCPU).Median, server, ratio)
		if s.Footnote != "" {
			notes = append(notes, fmt.Sprintf("%s: %s", s.Name, s.Footnote))
		}
		if n, first := s.errors(); n > 0 {
			notes = append(notes, fmt.Sprintf("%s: %d operations FAILED, the first with: %v", s.Name, n, first))
		}
	}
	tw.Flush()
	notes = append(notes,
		fmt.Sprintf("every figure is the median of %d runs of each row, the rows' runs interleaved; min/max %%: the slowest and fastest run's ops/s against the median", rep.runs),
		"vs baseline: the median, and the extremes, of the run-by-run ratios of ops/s to the baseline's run measured close to it",
		"allocs/op, cpu µs/op: heap allocations and CPU time of this process per operation (the HTTP rows' include the HTTP server's)",
		"redis µs/op: redis-server's CPU time per operation (INFO cpu; a standalone redis-server only)")
	for _, n := range notes {
		fmt.Fprintln(w, "  "+n)
	}
}

// percents prints how far the slowest and the fastest run were from the
// median.
func percents(s spread) string {
	return fmt.Sprintf("%+.0f/%+.0f", 100*(s.Min/s.Median-1), 100*(s.Max/s.Median-1))
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

	writeCommands(w, rep)

	fmt.Fprintln(w, "\nRedis memory per completed record (MEMORY USAGE, Content-Type header and a JSON body; prefix as long as the default idem:):")
	if rep.memSkip != "" {
		fmt.Fprintf(w, "  not measured: %s\n", rep.memSkip)
	}
	for _, m := range rep.memory {
		fmt.Fprintf(w, "  %6d-byte body, %2d-byte key name: %6d bytes, overhead %d bytes", m.Body, m.Name, m.Usage, m.Overhead())
		if m.CompressAbove > 0 {
			fmt.Fprintf(w, " (RedisOptions.CompressAbove %d)", m.CompressAbove)
		}
		fmt.Fprintln(w)
	}

	fmt.Fprintf(w, "\nPostgreSQL disk per completed record (pg_total_relation_size over %d records after VACUUM, indexes included; 36-byte key names):\n", cfg.sizeRecords)
	if rep.pgSkip != "" {
		fmt.Fprintf(w, "  not measured: %s\n", rep.pgSkip)
	}
	for _, m := range rep.pgBytes {
		fmt.Fprintf(w, "  %6d-byte body: %6d bytes (a body over about 2 KB is compressed by TOAST)\n", m.Body, m.Usage)
	}
	writeCapacity(w, rep)
	writeResponses(w, rep.responses, cfg.sizeRecords)

	fmt.Fprintf(w, "\nCompressing a %d-byte JSON response body with gzip (one core, writer and reader reused):\n", rep.gzipBody)
	for _, c := range rep.gzip {
		fmt.Fprintf(w, "  %-18s %5d bytes (%2.0f %%), saves %5d bytes; %4.0f µs to compress, %3.0f µs to decompress\n",
			c.Name+":", c.Size, 100*float64(c.Size)/float64(rep.gzipBody), rep.gzipBody-c.Size,
			float64(c.Compress.Nanoseconds())/1e3, float64(c.Decompress.Nanoseconds())/1e3)
	}
	if s := rep.row(newOp); s != nil && len(rep.gzip) > 0 {
		ops := s.ops().Median
		fmt.Fprintf(w, "  for scale: a %s here costs about %.0f µs of CPU (%d cores / %.0f ops/s), server included\n",
			newOp, float64(runtime.NumCPU())*1e6/ops, runtime.NumCPU(), ops)
	}

	fmt.Fprintf(w, "\nBudgets (medians of the run-by-run ratios, min–max over %d runs; rows without @1 run %d concurrent operations):\n", rep.runs, cfg.concurrency)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, c := range budgets(rep) {
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", c.verdict, c.what, c.got)
	}
	tw.Flush()
	fmt.Fprintln(w, "\nClient cost (heap allocations per operation, medians; to follow, not judged):")
	for _, c := range clientCosts(rep) {
		fmt.Fprintf(w, "  %s\n", c)
	}

	fmt.Fprintln(w, "\nMachine:")
	fmt.Fprintf(w, "  %s/%s, %d CPUs (GOMAXPROCS %d), %s\n", runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version())
	fmt.Fprintf(w, "  Redis %s, %d connections in the pool\n", e.redisVersion, cfg.concurrency)
	if e.throwaway {
		fmt.Fprintln(w, "  Redis started by the bench, emptied (FLUSHALL) before every run of every row")
	}
	if cfg.replicas > 0 {
		fmt.Fprintf(w, "  the library's writes confirmed by %d replicas (RedisOptions.Replicas)\n", cfg.replicas)
	}
	if e.pgVersion != "" {
		fmt.Fprintf(w, "  PostgreSQL %s, %d connections in the pool\n", e.pgVersion, cfg.concurrency)
	} else {
		fmt.Fprintf(w, "  %s\n", e.pgSkip)
	}
	fmt.Fprintf(w, "  %s\n", e.valkeyNote())
	fmt.Fprintf(w, "  %d runs of %v per row, %d concurrent operations unless @1; client and servers share this machine\n", cfg.runs, cfg.duration, cfg.concurrency)
	writeNeighbours(w, rep)
}

// writeNeighbours says how much CPU the machine's other processes, and the
// hypervisor's other machines, took during the runs: on a shared machine,
// the largest source of noise. The postgres and valkey rows are left out,
// since there the other processes include their server.
func writeNeighbours(w io.Writer, rep *report) {
	var others, steal []float64
	for _, s := range rep.rows {
		if onPostgres(s.Name) || onValkey(s.Name) {
			continue
		}
		for _, r := range s.Runs {
			others, steal = append(others, r.Others), append(steal, r.Steal)
		}
	}
	quiet := true
	for _, c := range []struct {
		what string
		cpu  spread
	}{
		{"other processes used", spreadOf(others)},
		{"the hypervisor gave other machines (steal)", spreadOf(steal)},
	} {
		if !math.IsNaN(c.cpu.Median) {
			fmt.Fprintf(w, "  %s %.2f of a core in the median run, %.2f at most\n", c.what, c.cpu.Median, c.cpu.Max)
			quiet = quiet && c.cpu.Max < 0.1
		}
	}
	if !quiet {
		fmt.Fprintln(w, "  WARNING: the machine was not quiet: ops/s suffer, and the run-by-run ratios less")
	}
}
