package linearizable_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
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
// enough to mean something, and reports it.
func checked(t *testing.T, store string, res linearizable.Result, faults map[string]int) {
	t.Helper()
	report.Add(t, report.Entry{Suite: "linearizable", Store: store, Faults: faults, Operations: res.Operations,
		Linearizable: string(res.Verdict), Notes: fmt.Sprintf("%d records, %d outcomes unknown", res.Records, res.UnknownOutcomes)})
	require.Equal(t, porcupine.Ok, res.Verdict)
	require.Greater(t, res.Operations, 100)
}

func TestMemoryStore(t *testing.T) {
	checked(t, "memory", linearizable.Check(t, idempotency.NewMemoryStore(idempotency.MemoryOptions{}), linearizable.Options{}), nil)
}

func TestRedisStore(t *testing.T) {
	checked(t, "redis", linearizable.Check(t, redisStore(t, testserver.StartRedis(t).Client()), linearizable.Options{}), nil)
}

func TestPostgresStore(t *testing.T) {
	pool, err := pgxpool.New(t.Context(), testserver.StartPostgres(t).DSN)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	s := postgres.New(pool, postgres.Options{})
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(t.Context()))
	checked(t, "postgres", linearizable.Check(t, s, linearizable.Options{}), nil)
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
	store := redisStore(t, redis.NewClient(&redis.Options{Addr: proxy.Addr(), MaxRetries: -1}))

	ctx, stop := context.WithCancel(t.Context())
	var faults map[string]int
	var wg sync.WaitGroup
	wg.Go(func() { faults = inject(ctx, proxy) })
	res := linearizable.Check(t, store, linearizable.Options{Duration: 3 * time.Second})
	stop()
	wg.Wait()
	t.Logf("faults injected: %v", faults)
	checked(t, "redis", res, faults)
	require.Positive(t, res.UnknownOutcomes, "no call failed: the faults missed")
}

// inject puts a fault on p every 20 to 100ms until ctx is done, and counts
// them by kind.
func inject(ctx context.Context, p *faultproxy.Proxy) map[string]int {
	n := map[string]int{}
	for {
		select {
		case <-ctx.Done():
			p.SetLatency(0)
			return n
		case <-time.After(20*time.Millisecond + rand.N(80*time.Millisecond)):
		}
		switch rand.N(5) {
		case 0:
			p.ResetAll()
			n["reset all"]++
		case 1:
			p.ResetOnNextRequest(true)
			n["reset after a request"]++
		case 2:
			p.ResetOnNextRequest(false)
			n["reset before a request"]++
		case 3:
			p.SetLatency(rand.N(15 * time.Millisecond))
			n["latency"]++
		case 4:
			p.Partition()
			time.Sleep(rand.N(50 * time.Millisecond))
			p.Heal()
			n["partition"]++
		}
	}
}

func redisStore(t *testing.T, c *redis.Client) *idempotency.RedisStore {
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
