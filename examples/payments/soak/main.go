// Command soak runs the payments example as a service of several instances
// on one store, under client load and random chaos, and then audits what the
// service did: every logical charge charged exactly once at the gateway,
// every completed key replaying its stored answer byte for byte, no record
// left in flight, every client answered.
//
// Usage, from the repository root:
//
//	go run ./examples/payments/soak -store redis|postgres -duration 10m [-instances 3] [-seed N]
//
// It starts a throwaway redis-server or PostgreSQL (or uses -redis ADDR /
// -postgres DSN), builds examples/payments once, and runs the instances as
// OS processes, each reaching the store through a Toxiproxy of its own.
// Clients retry each logical charge under one Idempotency-Key until it has
// a final answer, some sending it twice at once to different instances,
// some sending again keys answered long ago. The chaos, drawn from -seed:
// kill -9 of an instance (a new one takes its place), SIGSTOP and SIGCONT,
// and latency, resets, timeouts, partitions and truncation on an instance's
// link to the store. It prints one summary, appends one entry to
// $IDEMPOTENCY_REPORT (see internal/testkit/report), and exits 1 on any violation.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

// config is the soak's flags.
type config struct {
	store              string // "redis" or "postgres"
	redis, postgres    string // a store given instead of a throwaway one
	duration           time.Duration
	instances, clients int
	seed               uint64
	// The instances' flags: their Guard's lease and wait, how often they
	// sweep, the gateway's latency.
	lease, wait, sweep, work time.Duration
}

func main() {
	log.SetFlags(0)
	log.SetPrefix("soak: ")
	var cfg config
	flag.StringVar(&cfg.store, "store", "redis", "the store: redis or postgres")
	flag.StringVar(&cfg.redis, "redis", "", "use this Redis `HOST:PORT` (emptied first) instead of starting one")
	flag.StringVar(&cfg.postgres, "postgres", "", "use this PostgreSQL `DSN` instead of starting one")
	flag.DurationVar(&cfg.duration, "duration", time.Minute, "how long the chaos and the load last")
	flag.IntVar(&cfg.instances, "instances", 3, "payments instances sharing the store")
	flag.IntVar(&cfg.clients, "clients", 16, "client goroutines")
	flag.Uint64Var(&cfg.seed, "seed", uint64(time.Now().UnixNano()), "seed of the chaos and of the clients' choices")
	flag.DurationVar(&cfg.lease, "lease", 2*time.Second, "the instances' -lease: how long a killed owner holds its records")
	flag.DurationVar(&cfg.wait, "wait", 5*time.Second, "the instances' -wait")
	flag.DurationVar(&cfg.sweep, "sweep", 500*time.Millisecond, "the instances' -sweep")
	flag.DurationVar(&cfg.work, "work", 20*time.Millisecond, "the instances' -work: the gateway's latency")
	flag.Parse()
	if cfg.store == "redis" && cfg.postgres != "" || cfg.store == "postgres" && cfg.redis != "" {
		log.Fatalf("-store %s does not go with the other store's flag", cfg.store)
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	s, err := run(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	s.print(os.Stdout)
	if err := report.Write(s.entry()); err != nil {
		log.Print(err)
	}
	if n := s.violations(); n > 0 {
		fmt.Fprintf(os.Stderr, "soak: %d violations\n", n)
		os.Exit(1)
	}
}
