// Command payments is a small payments API built on the idempotency library.
// POST /v1/charges charges a card through a simulated payment gateway at
// most once per Idempotency-Key, however often the client retries and
// whichever instance each retry reaches, as long as the instances share one
// Redis or one PostgreSQL.
//
// Usage:
//
//	payments [-addr 127.0.0.1:8080] [-redis HOST:PORT | -cluster ADDR,... | -postgres DSN]
//		[-work 20ms] [-lease 0] [-wait 0] [-sweep 0] [-recovery-points=true]
//
// Without -redis, -cluster or -postgres it runs on an embedded Redis
// (miniredis), which no other process sees: fine for a try-out, not for
// several instances.
//
// GET /metrics serves the service's metrics in the Prometheus format,
// through OpenTelemetry: the Guard's, from the idempotencyotel Observer, and
// the store's records in flight and abandoned (Stats), read on each scrape.
//
// A charge is three steps: place the order, charge the card, send the
// receipt. Each runs through idempotency.Step, which records its result (a
// recovery point) before the next step begins; then the charge is written
// to the ledger and its 201 stored. An attempt after a crash resumes after
// the last step recorded instead of starting over, so no step runs twice.
//
// The orders, the gateway, the receipts and the ledger live in the same
// database as the idempotency records. The orders and the receipts keep a
// row per call. The gateway deduplicates on its own idempotency key, which
// the handler derives with idempotency.DownstreamKey, as a real provider
// would. On PostgreSQL the order row and its recovery point commit in one
// transaction (postgres.Store.StepTx), and so do the ledger's row and the
// stored answer (postgres.Store.CompleteTx): the ledger holds a charge if
// and only if its answer is stored.
//
// A crash can still fall inside a step, after its effect and before its
// record. The operation is then abandoned once its lease runs out, and the
// recovery hook (idempotency.Options.Recover) settles it without running
// anything blindly: it reads the steps recorded and asks the service of the
// next one whether it happened under this operation, recording what the
// service says. If the card was charged, the hook finishes the charge (the
// receipt, unless one was sent, and the ledger) and stores the very 201 the
// handler would have sent; if not, it releases the key, and the handler
// runs, resuming after the steps recorded. A client's retry runs the hook;
// with -sweep, each instance also runs it every interval on abandoned
// operations that no client retries, so a charge made just before a crash
// reaches the ledger anyway.
//
// With -recovery-points=false the handler runs the steps without Step, and
// there is no hook: an attempt after a crash runs every step again, and
// only the gateway's key keeps the card from being charged twice. The
// tests' kill audit (TestKillAudit) runs both ways and counts the steps
// run; -crash-after and -crash-every crash its instances between steps.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
	"github.com/idempotency-go/idempotency/postgres"
)

type config struct {
	addr, redis, cluster     string
	postgres                 string
	work, lease, wait, sweep time.Duration
	resume                   bool
	crashAfter               string
	crashEvery               int
}

func main() {
	log.SetPrefix("payments: ")
	var cfg config
	flag.StringVar(&cfg.addr, "addr", "127.0.0.1:8080", "`address` to listen on; port 0 picks a free port")
	flag.StringVar(&cfg.redis, "redis", "", "Redis `HOST:PORT` shared by every instance (default: an embedded Redis, not shared)")
	flag.StringVar(&cfg.cluster, "cluster", "", "Redis Cluster seed nodes `ADDR,ADDR,...` shared by every instance, instead of -redis")
	flag.StringVar(&cfg.postgres, "postgres", "", "PostgreSQL `DSN` shared by every instance, instead of Redis")
	flag.DurationVar(&cfg.work, "work", 20*time.Millisecond, "time the simulated gateway takes per call")
	flag.DurationVar(&cfg.lease, "lease", 0, "the idempotency lease (0: the library's default)")
	flag.DurationVar(&cfg.wait, "wait", 0, "how long a duplicate waits for the original (0: the library's default; negative: do not wait)")
	flag.DurationVar(&cfg.sweep, "sweep", 0, "how often to settle abandoned operations no client retries (0: never)")
	flag.BoolVar(&cfg.resume, "recovery-points", true, "record each step of a charge, so that a retry after a crash resumes after the last one; "+
		"false: every attempt runs every step, with no recovery hook")
	flag.StringVar(&cfg.crashAfter, "crash-after", "", "for tests: kill the process (SIGKILL) right after every -crash-every'th run of this `step` (order, charge or receipt) by a first attempt")
	flag.IntVar(&cfg.crashEvery, "crash-every", 4, "see -crash-after")
	flag.Parse()
	if err := run(cfg); err != nil {
		log.Fatal(err)
	}
}

func run(cfg config) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if cfg.sweep > 0 && !cfg.resume {
		return errors.New("-sweep needs the recovery hook, which -recovery-points=false turns off")
	}
	crash, err := newCrasher(cfg.crashAfter, cfg.crashEvery)
	if err != nil {
		return err
	}
	b, err := open(ctx, cfg)
	if err != nil {
		return err
	}
	defer b.close()
	m, err := newMetrics(b.stats)
	if err != nil {
		return err
	}
	// Deferred after b.close, so it runs before it: no scrape reads a
	// closed store.
	defer m.shutdown()
	a := &api{orders: b.orders, gateway: b.gateway, receipts: b.receipts, ledger: b.ledger, metrics: m.handler,
		resume: cfg.resume, crash: crash}
	// A claim the store has not answered in 2 s is answered 503, so the
	// client retries on another instance rather than wait on a silent
	// link; the store clients below honour that deadline.
	opts := idempotency.Options{Lease: cfg.lease, WaitTimeout: cfg.wait, Observer: m.observer, ClaimTimeout: 2 * time.Second}
	if a.resume {
		opts.Recover = a.recoverCharge
	}
	guard := idempotency.New(b.store, opts)
	defer m.observer.Track(guard)()
	if cfg.sweep > 0 {
		sweepCtx, stopSweep := context.WithCancel(ctx)
		swept := make(chan struct{})
		go func() {
			defer close(swept)
			sweep(sweepCtx, guard, cfg.sweep)
		}()
		// Deferred after b.close, so it runs before it: the backends stay
		// open until the sweeper is gone.
		defer func() { stopSweep(); <-swept }()
	}
	return serve(ctx, cfg.addr, a.routes(guard))
}

// serve serves h on addr until ctx is done, then shuts down.
func serve(ctx context.Context, addr string, h http.Handler) error {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	log.Printf("listening on %s", ln.Addr())
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	// Let running handlers finish, so that their outcomes are stored
	// rather than left for a takeover after the lease.
	log.Print("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return srv.Shutdown(sctx)
}

// sweep settles, every interval until ctx is done, up to 100 abandoned
// operations at a time. Instances may all sweep: each record is settled by
// one of them. A sweep cut short by shutdown is harmless: the record it was
// settling stays abandoned for the next sweep or retry.
func sweep(ctx context.Context, guard *idempotency.Guard, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := guard.Sweep(ctx, 100)
		if err != nil && ctx.Err() == nil {
			log.Printf("sweep: %v", err)
		}
		if n > 0 {
			log.Printf("sweep: settled %d abandoned operations", n)
		}
	}
}

// backends is the state every instance shares: the idempotency records, the
// orders, the gateway, the receipts and the ledger, all in one database.
type backends struct {
	store    idempotency.Store
	stats    idempotencyotel.StatsReader // the same store, for the metrics' gauges
	orders   orders
	gateway  gateway
	receipts receipts
	ledger   ledger
	close    func()
}

func open(ctx context.Context, cfg config) (*backends, error) {
	given := 0
	for _, v := range []string{cfg.redis, cfg.cluster, cfg.postgres} {
		if v != "" {
			given++
		}
	}
	if given > 1 {
		return nil, errors.New("give one of -redis, -cluster and -postgres")
	}
	if cfg.postgres != "" {
		return openPostgres(ctx, cfg)
	}
	return openRedis(ctx, cfg)
}

func openPostgres(ctx context.Context, cfg config) (*backends, error) {
	pc, err := pgxpool.ParseConfig(cfg.postgres)
	if err != nil {
		return nil, err
	}
	// pgx bounds a query by its context, which the Guard gives a deadline
	// (Options.ClaimTimeout for a claim, the lease's end for an owner's
	// calls); dialling is bounded by ConnectTimeout alone.
	if pc.ConnConfig.ConnectTimeout == 0 {
		pc.ConnConfig.ConnectTimeout = 2 * time.Second
	}
	// Connections made up front: a new PostgreSQL backend can take a large
	// part of a lease to start, and an owner's write would wait for it.
	if pc.MinConns == 0 {
		pc.MinConns = min(4, pc.MaxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, err
	}
	store := postgres.New(pool, postgres.Options{})
	pg, err := newPostgresBackend(ctx, pool, store, cfg.work)
	if err == nil {
		err = store.Migrate(ctx)
	}
	if err != nil {
		pool.Close()
		return nil, err
	}
	return &backends{store: store, stats: store, orders: pg, gateway: pg, receipts: pg, ledger: pg,
		close: func() { store.Close(); pool.Close() }}, nil
}

func openRedis(ctx context.Context, cfg config) (*backends, error) {
	addr := cfg.redis
	closeEmbedded := func() {}
	embedded := addr == "" && cfg.cluster == ""
	if embedded {
		m := miniredis.NewMiniRedis()
		if err := m.Start(); err != nil {
			return nil, err
		}
		addr, closeEmbedded = m.Addr(), m.Close
		log.Printf("WARNING: no -redis or -postgres: using an embedded Redis (miniredis) at %s. "+
			"It is not shared between processes: instances started this way do not act as one service.", addr)
	}
	// ContextTimeoutEnabled lets the Guard's deadlines bound the socket
	// too: a claim's (Options.ClaimTimeout) and an owner's calls' (the
	// lease's end). Without it a call on a silent connection (a partition:
	// nothing answers, nothing is closed) waits out go-redis's 3 s
	// ReadTimeout whatever its deadline, and is resent up to MaxRetries (3)
	// times: in the soak (examples/payments/soak) that kept clients up to 9 s
	// before the 503 that sends them to another instance.
	var c redis.UniversalClient = redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, ContextTimeoutEnabled: true})
	if cfg.cluster != "" {
		addr = cfg.cluster
		c = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(cfg.cluster, ","), DialTimeout: time.Second, ContextTimeoutEnabled: true})
	}
	if err := c.Ping(ctx).Err(); err != nil {
		c.Close()
		closeEmbedded()
		return nil, fmt.Errorf("redis %s: %w", addr, err)
	}
	store, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	if err == nil && !embedded {
		// A server that may evict would lose records, and a retry would
		// charge again: refuse to serve on it. (miniredis never evicts,
		// and has no INFO memory to say so.)
		if err = store.CheckEviction(ctx); err != nil {
			store.Close()
		}
	}
	if err != nil {
		c.Close()
		closeEmbedded()
		return nil, err
	}
	rb := &redisBackend{c: c, latency: cfg.work}
	return &backends{store: store, stats: store, orders: rb, gateway: rb, receipts: rb, ledger: rb, close: func() {
		store.Close()
		c.Close()
		closeEmbedded()
	}}, nil
}
