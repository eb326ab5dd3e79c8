package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// charge is the part of the payments example's charge the audit reads.
type charge struct {
	ID     string `json:"id"`
	Amount int64  `json:"amount"`
}

// backend is the store every instance shares, read directly (not through
// the proxies, not through the service) by the audit.
type backend interface {
	// upstream is the store's HOST:PORT, where the proxies forward.
	upstream() string
	// flags are an instance's flags to reach the store at addr.
	flags(addr string) []string
	// gatewayCharges and ledger are the example's own tables.
	gatewayCharges(ctx context.Context) ([]charge, error)
	ledger(ctx context.Context) ([]charge, error)
	// inFlight counts the idempotency records in flight, and the entries
	// of the index of records in flight (Redis; PostgreSQL has none).
	inFlight(ctx context.Context) (records, indexed int, err error)
	close() error
}

// openBackend connects to the store cfg gives, or launches a throwaway one.
func openBackend(ctx context.Context, cfg config) (backend, error) {
	switch cfg.store {
	case "redis":
		addr, stop := cfg.redis, func() error { return nil }
		if addr == "" {
			r, s, err := testserver.LaunchRedis()
			if err != nil {
				return nil, err
			}
			addr, stop = r.Addr, s
		}
		c := redis.NewClient(&redis.Options{Addr: addr})
		// A given server may hold an earlier soak's records and charges,
		// which the audit would count as this one's.
		if err := c.FlushAll(ctx).Err(); err != nil {
			return nil, errors.Join(fmt.Errorf("redis %s: %w", addr, err), c.Close(), stop())
		}
		return &redisBackend{addr: addr, c: c, stop: stop}, nil
	case "postgres":
		dsn, stop := cfg.postgres, func() error { return nil }
		if dsn == "" {
			p, s, err := testserver.LaunchPostgres()
			if err != nil {
				return nil, err
			}
			dsn, stop = p.DSN, s
		}
		u, err := url.Parse(dsn)
		if err == nil && u.Host == "" {
			err = errors.New("the DSN must be a URL with a host:port")
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("-postgres: %w", err), stop())
		}
		c, err := pgx.Connect(ctx, dsn)
		if err == nil {
			// Instances create the tables; a given database may hold an
			// earlier soak's.
			_, err = c.Exec(ctx, `DROP TABLE IF EXISTS idempotency_records, payments_gateway_calls,
				payments_gateway_charges, payments_ledger, payments_orders, payments_receipts`)
		}
		if err != nil {
			return nil, errors.Join(fmt.Errorf("postgres: %w", err), stop())
		}
		return &postgresBackend{dsn: u, c: c, stop: stop}, nil
	}
	return nil, fmt.Errorf("-store %q: want redis or postgres", cfg.store)
}

type redisBackend struct {
	addr string
	c    *redis.Client
	stop func() error
}

func (b *redisBackend) upstream() string           { return b.addr }
func (b *redisBackend) flags(addr string) []string { return []string{"-redis", addr} }

func (b *redisBackend) gatewayCharges(ctx context.Context) ([]charge, error) {
	return b.charges(ctx, "payments:{gateway}:charges")
}

func (b *redisBackend) ledger(ctx context.Context) ([]charge, error) {
	return b.charges(ctx, "payments:{ledger}")
}

func (b *redisBackend) charges(ctx context.Context, hash string) ([]charge, error) {
	vs, err := b.c.HVals(ctx, hash).Result()
	if err != nil {
		return nil, err
	}
	cs := make([]charge, len(vs))
	for i, v := range vs {
		if err := json.Unmarshal([]byte(v), &cs[i]); err != nil {
			return nil, fmt.Errorf("%s: %w", hash, err)
		}
	}
	return cs, nil
}

// inFlight reads every record (state byte 'p': in flight) and every
// idem:{N}:leases set, the index the sweeper lists.
func (b *redisBackend) inFlight(ctx context.Context) (records, indexed int, err error) {
	iter := b.c.Scan(ctx, 0, "idem:*", 1000).Iterator()
	for iter.Next(ctx) {
		k := iter.Val()
		if strings.HasSuffix(k, ":leases") {
			n, err := b.c.ZCard(ctx, k).Result()
			if err != nil {
				return 0, 0, err
			}
			indexed += int(n)
			continue
		}
		if strings.HasSuffix(k, ":seq") {
			continue
		}
		state, err := b.c.GetRange(ctx, k, 0, 0).Result()
		if err != nil {
			return 0, 0, err
		}
		if state == "p" {
			records++
		}
	}
	return records, indexed, iter.Err()
}

func (b *redisBackend) close() error { return errors.Join(b.c.Close(), b.stop()) }

type postgresBackend struct {
	dsn  *url.URL
	c    *pgx.Conn
	stop func() error
}

func (b *postgresBackend) upstream() string { return b.dsn.Host }

func (b *postgresBackend) flags(addr string) []string {
	u := *b.dsn
	u.Host = addr
	return []string{"-postgres", u.String()}
}

func (b *postgresBackend) gatewayCharges(ctx context.Context) ([]charge, error) {
	rows, _ := b.c.Query(ctx, `SELECT charge FROM payments_gateway_charges`)
	return pgx.CollectRows(rows, pgx.RowTo[charge])
}

func (b *postgresBackend) ledger(ctx context.Context) ([]charge, error) {
	rows, _ := b.c.Query(ctx, `SELECT charge FROM payments_ledger`)
	return pgx.CollectRows(rows, pgx.RowTo[charge])
}

func (b *postgresBackend) inFlight(ctx context.Context) (records, indexed int, err error) {
	err = b.c.QueryRow(ctx, `SELECT count(*) FROM idempotency_records WHERE state = 'in_progress'`).Scan(&records)
	return records, 0, err
}

func (b *postgresBackend) close() error {
	return errors.Join(b.c.Close(context.Background()), b.stop())
}

// build compiles examples/payments into dir. The package path, not a
// directory, so that it works from anywhere in the workspace.
func build(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "payments")
	out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, "github.com/idempotency-go/idempotency/examples/payments").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building examples/payments: %v\n%s", err, out)
	}
	return bin, nil
}

// process is one running payments instance.
type process struct {
	url    string
	cmd    *exec.Cmd
	exited chan struct{} // closed once it has exited and been reaped
}

// startProcess runs bin with args on a free port, its stderr appended to
// logPath, and returns once it listens.
func startProcess(bin string, args []string, logPath string) (*process, error) {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, append([]string{"-addr", "127.0.0.1:0"}, args...)...)
	// An instance must not outlive a soak that dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	stderr, err := cmd.StderrPipe()
	if err == nil {
		err = cmd.Start()
	}
	if err != nil {
		logf.Close()
		return nil, err
	}
	p := &process{cmd: cmd, exited: make(chan struct{})}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(io.TeeReader(stderr, logf))
		for sc.Scan() {
			if _, a, ok := strings.Cut(sc.Text(), "listening on "); ok {
				select {
				case addr <- a:
				default:
				}
			}
		}
		// Wait closes the pipe, so it comes after the last read.
		_ = cmd.Wait()
		logf.Close()
		close(p.exited)
	}()
	select {
	case a := <-addr:
		p.url = "http://" + a
		return p, nil
	case <-p.exited:
		return nil, fmt.Errorf("payments exited before listening; see %s", logPath)
	case <-time.After(20 * time.Second):
		p.kill()
		return nil, fmt.Errorf("payments did not listen within 20s; see %s", logPath)
	}
}

func (p *process) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.exited
}

func (p *process) signal(sig syscall.Signal) { _ = p.cmd.Process.Signal(sig) }

// slot is one instance's place in the service: its proxy to the store,
// which stays, and its process, which a kill replaces.
type slot struct {
	id    int
	proxy *toxiproxy.Proxy
	args  []string
	bin   string
	dir   string

	mu   sync.Mutex
	proc *process
	gen  int // how many processes this slot has had
}

// current is the slot's process and its generation.
func (s *slot) current() (*process, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc, s.gen
}

// restart kills the slot's process with SIGKILL, as a crash would, and
// starts a new one in its place.
func (s *slot) restart() error {
	p, _ := s.current()
	p.kill()
	return s.start()
}

func (s *slot) start() error {
	s.mu.Lock()
	gen := s.gen + 1
	s.mu.Unlock()
	p, err := startProcess(s.bin, s.args, filepath.Join(s.dir, fmt.Sprintf("instance-%d.%d.log", s.id, gen)))
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.proc, s.gen = p, gen
	s.mu.Unlock()
	return nil
}

// service is the instances, each behind its own Toxiproxy to the store.
type service struct {
	slots []*slot
	api   *toxiproxy.ApiServer
}

func startService(b backend, bin, dir string, cfg config) (*service, error) {
	api := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	svc := &service{api: api}
	for i := range cfg.instances {
		p := toxiproxy.NewProxy(api, "store-"+strconv.Itoa(i), "127.0.0.1:0", b.upstream())
		if err := p.Start(); err != nil {
			svc.stop()
			return nil, fmt.Errorf("toxiproxy: %w", err)
		}
		args := append(b.flags(p.Listen), "-lease", cfg.lease.String(), "-wait", cfg.wait.String(),
			"-sweep", cfg.sweep.String(), "-work", cfg.work.String())
		s := &slot{id: i, proxy: p, args: args, bin: bin, dir: dir}
		svc.slots = append(svc.slots, s)
		if err := s.start(); err != nil {
			svc.stop()
			return nil, err
		}
	}
	return svc, nil
}

// pick returns a slot at random and its process's URL: the clients do not
// know which instances are stopped, partitioned or being replaced.
func (svc *service) pick(r *rand.Rand) (*slot, string, int) {
	s := svc.slots[r.IntN(len(svc.slots))]
	p, gen := s.current()
	return s, p.url, gen
}

func (svc *service) stop() {
	for _, s := range svc.slots {
		if p, _ := s.current(); p != nil {
			p.kill()
		}
		s.proxy.Stop()
	}
}
