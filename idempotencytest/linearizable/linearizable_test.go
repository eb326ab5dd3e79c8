package linearizable_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"regexp"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest/linearizable"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// checked requires of a store's history that it was linearizable and long
// enough to mean something, recovery points included, and reports it.
func checked(t *testing.T, name string, store idempotency.Store, res linearizable.Result, faults map[string]int) {
	t.Helper()
	report.Add(t, report.Entry{Suite: "linearizable", Store: name, Faults: faults, Operations: res.Operations,
		Linearizable: string(res.Verdict), Notes: fmt.Sprintf("%d records, %d outcomes unknown, %d calls on recovery points",
			res.Records, res.UnknownOutcomes, res.StepCalls)})
	require.Equal(t, porcupine.Ok, res.Verdict)
	require.Greater(t, res.Operations, 100)
	_, ok := store.(idempotency.RecoveryPointStore)
	require.True(t, ok, "%T keeps no recovery points", store)
	require.Greater(t, res.StepCalls, 30)
}

func TestMemoryStore(t *testing.T) {
	s := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	checked(t, "memory", s, linearizable.Check(t, s, linearizable.Options{}), nil)
}

func TestRedisStore(t *testing.T) {
	s := redisStore(t, testserver.StartRedis(t).Client())
	checked(t, "redis", s, linearizable.Check(t, s, linearizable.Options{}), nil)
}

// A Redis Cluster of three masters, whose records spread over every one.
func TestRedisCluster(t *testing.T) {
	cl := testserver.StartCluster(t, 3, 0)
	s := redisStore(t, redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs}))
	checked(t, "redis-cluster", s, linearizable.Check(t, s, linearizable.Options{Keys: 6}), nil)
}

func TestPostgresStore(t *testing.T) {
	s := postgresStore(t, testserver.StartPostgres(t).DSN)
	checked(t, "postgres", s, linearizable.Check(t, s, linearizable.Options{}), nil)
}

// postgresStore is a migrated postgres.Store on a pool of dsn, both closed
// when t ends.
func postgresStore(t *testing.T, dsn string) *postgres.Store {
	pool, err := pgxpool.New(t.Context(), dsn)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(t.Context()))
	return s
}

// A redis-server behind a proxy that resets connections (before a request
// reaches the server, and after the server applied it but before its reply
// gets back), adds latency and partitions the link for moments, while the
// history runs: the calls that fail with ErrUnavailable may or may not have
// taken effect, and every answer that does come back must still fit.
//
// The client does not retry (MaxRetries -1). go-redis's retries send a
// script again when its reply was lost, and a call's two sends cannot be
// one point of a linearizable history once another call lands between
// them: a claim whose first send made the record, resent after its lease
// ran out and another claim took over, answers InFlight; a renewal or
// release resent so answers ErrFenced. The Store contract allows those
// answers (they leave the record as safe as a lost reply does), and
// TestRedisSettleRunTwice and TestRedisLostSettleReply in the root package
// check the resends. With retries this check found a completion answering
// ErrFenced for the outcome it had stored; that resend now succeeds.
func TestRedisStoreUnderFaults(t *testing.T) {
	srv := testserver.StartRedis(t)
	proxy := faultproxy.Start(t, srv.Addr)
	underFaults(t, "redis", proxy, 20*time.Millisecond, redisStore(t, redis.NewClient(&redis.Options{Addr: proxy.Addr(), MaxRetries: -1})))
}

// PostgreSQL behind the same faults, five times rarer: each costs a new
// connection, and a PostgreSQL connection takes several round trips to
// make. pgx sends each statement once.
func TestPostgresStoreUnderFaults(t *testing.T) {
	dsn, err := url.Parse(testserver.StartPostgres(t).DSN)
	require.NoError(t, err)
	proxy := faultproxy.Start(t, dsn.Host)
	dsn.Host = proxy.Addr()
	underFaults(t, "postgres", proxy, 100*time.Millisecond, postgresStore(t, dsn.String()))
}

// underFaults checks store, which reaches its server through proxy, while
// faults are injected into proxy, one every gap to 5*gap.
func underFaults(t *testing.T, name string, proxy *faultproxy.Proxy, gap time.Duration, store idempotency.Store) {
	ctx, stop := context.WithCancel(t.Context())
	var faults map[string]int
	var wg sync.WaitGroup
	wg.Go(func() {
		faults = inject(ctx, proxy, faultMix{every: gap, spread: 4 * gap, resetAfter: 1, partition: 50 * time.Millisecond, latency: 15 * time.Millisecond})
	})
	res := linearizable.Check(t, store, linearizable.Options{Duration: 3 * time.Second})
	stop()
	wg.Wait()
	t.Logf("faults injected: %v", faults)
	checked(t, name, store, res, faults)
	require.Positive(t, res.UnknownOutcomes, "no call failed: the faults missed")
}

// faultMix is how inject picks faults: one after every plus up to spread;
// a reset after a request weighs resetAfter, each other kind (a reset
// before a request, a reset of all, a partition of up to partition, a
// latency of up to latency) 1.
type faultMix struct {
	every, spread      time.Duration
	resetAfter         int
	partition, latency time.Duration
}

// inject puts faults of m on p until ctx is done, and counts them by kind.
func inject(ctx context.Context, p *faultproxy.Proxy, m faultMix) map[string]int {
	n := map[string]int{}
	for {
		select {
		case <-ctx.Done():
			p.SetLatency(0)
			return n
		case <-time.After(m.every + rand.N(m.spread)):
		}
		switch k := rand.N(m.resetAfter + 4); {
		case k < m.resetAfter:
			p.ResetOnNextRequest(true)
			n["reset after a request"]++
		case k == m.resetAfter:
			p.ResetOnNextRequest(false)
			n["reset before a request"]++
		case k == m.resetAfter+1:
			p.ResetAll()
			n["reset all"]++
		case k == m.resetAfter+2:
			p.Partition()
			time.Sleep(rand.N(m.partition))
			p.Heal()
			n["partition"]++
		default:
			p.SetLatency(rand.N(m.latency))
			n["latency"]++
		}
	}
}

func redisStore(t *testing.T, c redis.UniversalClient) *idempotency.RedisStore {
	s, err := idempotency.NewRedisStore(c, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// The checker must fail stores that break the contract, each in one way.
func TestCheckFailsBrokenStores(t *testing.T) {
	for _, c := range []struct {
		name  string
		store func() idempotency.Store
	}{
		{"SecondOwner", func() idempotency.Store {
			return &secondOwner{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{})}
		}},
		{"FencedCompletes", func() idempotency.Store {
			return fencedCompletes{idempotency.NewMemoryStore(idempotency.MemoryOptions{})}
		}},
		{"SlowClock", func() idempotency.Store {
			// Leases last twice as long as they were asked for.
			start := time.Now()
			return idempotency.NewMemoryStore(idempotency.MemoryOptions{
				Now: func() time.Time { return start.Add(time.Since(start) / 2) }})
		}},
		{"StaleOwnersSave", func() idempotency.Store {
			return staleSaves{idempotency.NewMemoryStore(idempotency.MemoryOptions{})}
		}},
		{"PointsLostOnRelease", func() idempotency.Store {
			return &releaseDrops{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
				points: map[idempotency.Key][]idempotency.RecoveryPoint{}}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := &failures{TB: t}
			res := linearizable.Check(f, c.store(), linearizable.Options{})
			require.Equal(t, porcupine.Illegal, res.Verdict)
			require.NotEmpty(t, f.errors)
			m := regexp.MustCompile(`visualization is (\S+)`).FindStringSubmatch(f.errors[len(f.errors)-1])
			require.NotNil(t, m, "no visualization named in %q", f.errors)
			require.FileExists(t, m[1])
		})
	}
}

// secondOwner answers a claim of a record in flight under a live lease as if
// it had taken the record over.
type secondOwner struct {
	idempotency.Store
	tokens atomic.Uint64
}

func (s *secondOwner) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	c, err := s.Store.Claim(ctx, req)
	if err == nil && c.State == idempotency.InFlight {
		return idempotency.Claim{State: idempotency.Owner, OperationID: req.OperationID, Attempt: 2,
			Token: 1<<40 + s.tokens.Add(1), Abandoned: true}, nil
	}
	return c, err
}

// fencedCompletes says it completed a record for a token that does not own
// it.
type fencedCompletes struct{ idempotency.Store }

func (s fencedCompletes) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	if err := s.Store.Complete(ctx, k, token, resp, retention); !errors.Is(err, idempotency.ErrFenced) {
		return err
	}
	return nil
}

// staleSaves says it saved a recovery point for a token that does not own
// the record.
type staleSaves struct{ *idempotency.MemoryStore }

func (s staleSaves) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	if err := s.MemoryStore.SaveRecoveryPoint(ctx, k, token, p); !errors.Is(err, idempotency.ErrFenced) {
		return err
	}
	return nil
}

// releaseDrops keeps recovery points apart from the records, and drops a
// record's when it is released, as it should only when the record is
// completed or forgotten.
type releaseDrops struct {
	*idempotency.MemoryStore
	mu     sync.Mutex
	points map[idempotency.Key][]idempotency.RecoveryPoint
}

func (s *releaseDrops) SaveRecoveryPoint(ctx context.Context, k idempotency.Key, token uint64, p idempotency.RecoveryPoint) error {
	if err := s.MemoryStore.SaveRecoveryPoint(ctx, k, token, p); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !slices.ContainsFunc(s.points[k], func(q idempotency.RecoveryPoint) bool { return q.Step == p.Step }) {
		s.points[k] = append(s.points[k], p)
	}
	return nil
}

func (s *releaseDrops) RecoveryPoints(ctx context.Context, k idempotency.Key, token uint64) ([]idempotency.RecoveryPoint, error) {
	if _, err := s.MemoryStore.RecoveryPoints(ctx, k, token); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.points[k]), nil
}

func (s *releaseDrops) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	return s.drop(k, s.MemoryStore.Complete(ctx, k, token, resp, retention))
}

func (s *releaseDrops) Forget(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.drop(k, s.MemoryStore.Forget(ctx, k, token))
}

func (s *releaseDrops) Release(ctx context.Context, k idempotency.Key, token uint64) error {
	return s.drop(k, s.MemoryStore.Release(ctx, k, token))
}

// drop drops k's points when err, a settling call's, is nil.
func (s *releaseDrops) drop(k idempotency.Key, err error) error {
	if err == nil {
		s.mu.Lock()
		delete(s.points, k)
		s.mu.Unlock()
	}
	return err
}

// failures is a testing.TB that keeps the failures reported with Errorf
// instead of failing the test. Check reports them from the goroutine that
// called it.
type failures struct {
	testing.TB
	errors []string
}

func (f *failures) Errorf(format string, args ...any) {
	f.errors = append(f.errors, fmt.Sprintf(format, args...))
}
