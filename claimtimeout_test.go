package idempotency

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// A store that stops answering claims: Do fails with ErrUnavailable once
// ClaimTimeout has passed when the first claim hangs; a waiter whose
// subscriptions or re-reads hang tries them again until its WaitTimeout,
// and then fails with ErrInFlight and ErrUnavailable. The operation never
// runs. The upper bounds on the elapsed time only catch a hang.
func TestClaimTimeout(t *testing.T) {
	const timeout, wait = 200 * time.Millisecond, time.Second
	fp := FingerprintOf("op", nil)
	for _, c := range []struct {
		name   string
		hangOn string // the store call that hangs
		held   bool   // another owner holds the key: the call waits
	}{
		{"the first claim", "claim", false},
		{"a waiter's subscription", "subscribe", true},
		{"a waiter's re-read", "watching claim", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			mem := NewMemoryStore(MemoryOptions{})
			k := Key{Name: "k"}
			if c.held {
				_, err := mem.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: fp, OperationID: "other", Lease: time.Minute, Retention: time.Hour})
				require.NoError(t, err)
			}
			claims, calls := 0, 0 // claims made; calls of the kind that hangs
			s := &faultStore{Store: mem, hook: func(ctx context.Context, op string) error {
				if op == "claim" {
					claims++
					if c.hangOn == "watching claim" && claims == 1 {
						return nil
					}
				}
				if op == c.hangOn || (c.hangOn == "watching claim" && op == "claim") {
					calls++
					return hang(t, ctx, false)
				}
				return nil
			}}
			g := New(s, Options{ClaimTimeout: timeout, WaitTimeout: wait})
			start := time.Now()
			_, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
				t.Error("the operation ran")
				return Response{}, nil
			})
			elapsed := time.Since(start)
			require.ErrorIs(t, err, ErrUnavailable)
			assert.GreaterOrEqual(t, elapsed, timeout)
			if !c.held {
				assert.ErrorContains(t, err, "Options.ClaimTimeout")
			} else {
				assert.ErrorIs(t, err, ErrInFlight, "the original is known to be running")
				assert.GreaterOrEqual(t, elapsed, wait, "the waiter gave up before its WaitTimeout")
				assert.GreaterOrEqual(t, calls, 2, "a hung %s was not tried again", c.hangOn)
			}
			assert.Less(t, elapsed, wait+timeout+5*time.Second, "Do hung past ClaimTimeout")
		})
	}
}

// A claim's context ends ClaimTimeout after it starts (default 5s), unless
// the caller's ends sooner; a negative ClaimTimeout leaves the caller's as
// it is.
func TestClaimTimeoutBound(t *testing.T) {
	mem := NewMemoryStore(MemoryOptions{})
	for _, c := range []struct {
		name    string
		opt     time.Duration
		caller  time.Duration // the caller's deadline from now; 0: none
		bounded time.Duration // the claim's, from now; 0: the caller's
	}{
		{"default", 0, 0, 5 * time.Second},
		{"set", time.Second, 0, time.Second},
		{"a caller that ends sooner", time.Second, 100 * time.Millisecond, 0},
		{"a caller that ends later", time.Second, time.Minute, time.Second},
		{"negative", -1, 0, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			if c.caller > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, c.caller)
				defer cancel()
			}
			bctx, cancel := New(mem, Options{ClaimTimeout: c.opt}).bounded(ctx)
			defer cancel()
			got, ok := bctx.Deadline()
			want, wantOK := ctx.Deadline()
			if c.bounded > 0 {
				want, wantOK = time.Now().Add(c.bounded), true
			}
			require.Equal(t, wantOK, ok)
			assert.WithinDuration(t, want, got, time.Second)
		})
	}
}

// An instance whose link to a real redis-server goes silent answers a new
// request with 503 after ClaimTimeout, instead of hanging until go-redis
// gives up, and the request takes nothing: once the link heals the same key
// runs at once. The client honours deadlines (ContextTimeoutEnabled), as the
// README asks.
func TestClaimTimeoutSilentRedis(t *testing.T) {
	const timeout = 300 * time.Millisecond
	srv := testserver.StartRedis(t)
	p := faultproxy.Start(t, srv.Addr)
	// A ReadTimeout far past the bound: only ClaimTimeout can end the call.
	c := redis.NewClient(&redis.Options{Addr: p.Addr(), ContextTimeoutEnabled: true, ReadTimeout: time.Minute, WriteTimeout: time.Minute})
	t.Cleanup(func() { c.Close() })
	g := New(newRedisStore(t, c), Options{ClaimTimeout: timeout})
	runs := 0
	h := g.Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.WriteHeader(http.StatusCreated)
	}))
	post := func() (*httptest.ResponseRecorder, time.Duration) {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader("{}"))
		req.Header.Set(HeaderKey, "silent-1")
		w := httptest.NewRecorder()
		start := time.Now()
		h.ServeHTTP(w, req)
		return w, time.Since(start)
	}
	// A first call warms the connection, so the partition swallows a claim
	// and not a dial.
	_, err := g.store.Claim(context.Background(), ClaimRequest{Key: Key{Name: "warm"}, Fingerprint: FingerprintOf("op", nil), OperationID: "op_warm", Lease: time.Second, Retention: time.Minute})
	require.NoError(t, err)

	p.Partition()
	w, elapsed := post()
	assert.Equal(t, http.StatusServiceUnavailable, w.Code)
	assert.NotEmpty(t, w.Header().Get("Retry-After"))
	assert.Less(t, elapsed, timeout+10*time.Second, "the request hung on the silent link")
	t.Logf("answered 503 after %v on a silent link (ClaimTimeout %v)", elapsed.Round(time.Millisecond), timeout)
	assert.Zero(t, runs)

	p.Heal()
	require.Eventually(t, func() bool { w, _ := post(); return w.Code == http.StatusCreated }, 5*time.Second, 50*time.Millisecond)
	assert.Equal(t, 1, runs)
}

// A store's own error, returned before ClaimTimeout, is kept as it is: it is
// not made out to be the store's silence (ErrUnavailable), which would, say,
// let the middleware's FailOpen run a handler unguarded.
func TestClaimTimeoutKeepsStoreErrors(t *testing.T) {
	boom := errors.New("boom")
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(context.Context, string) error { return boom }}
	_, err := New(s, Options{}).Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(context.Context) (Response, error) {
		t.Error("the operation ran")
		return Response{}, nil
	})
	require.ErrorIs(t, err, boom)
	assert.NotErrorIs(t, err, ErrUnavailable)
	assert.NotContains(t, err.Error(), "ClaimTimeout")
}

// A waiter's re-read that took the record over but was cut off by
// ClaimTimeout is found again by the next re-read, which carries the same
// operation ID (Redis answers it Owner, the server's lease counted from the
// first): the owner's lease then counts from the first send too, so its
// context ends before the server's lease does, whatever the renewals do.
func TestResentReReadCountsTheLeaseFromTheFirstSend(t *testing.T) {
	const lease, timeout = 3 * time.Second, time.Second
	s := &resentClaims{Store: NewMemoryStore(MemoryOptions{})}
	g := New(s, Options{Lease: lease, ClaimTimeout: timeout, WaitTimeout: time.Minute})
	var done time.Time
	_, _ = g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(ctx context.Context) (Response, error) {
		<-ctx.Done()
		done = time.Now()
		return Response{}, ctx.Err()
	})
	s.mu.Lock()
	defer s.mu.Unlock()
	require.Equal(t, 3, s.claims, "the claims the test scripts")
	require.Positive(t, s.heartbeats, "no renewal was tried")
	assert.True(t, done.Before(s.applied.Add(lease)),
		"the operation ran %v past the server's lease", done.Sub(s.applied.Add(lease)))
}

// resentClaims answers a Guard's claims as a Redis store does when a
// waiter's re-read took the record over and its reply was lost: the first
// claim finds the record in flight, the second is applied (at applied) and
// never answered, the third, the same claim sent again, is the owner. Every
// renewal fails.
type resentClaims struct {
	Store
	mu         sync.Mutex
	claims     int
	heartbeats int
	applied    time.Time
}

func (s *resentClaims) Claim(ctx context.Context, req ClaimRequest) (Claim, error) {
	s.mu.Lock()
	s.claims++
	n := s.claims
	if n == 2 {
		s.applied = time.Now()
	}
	s.mu.Unlock()
	switch n {
	case 1:
		return Claim{State: InFlight, LeaseLeft: time.Hour}, nil
	case 2:
		<-ctx.Done()
		return Claim{}, storeerr.Unavailable("claim", ctx.Err())
	}
	return Claim{State: Owner, OperationID: req.OperationID, Attempt: 2, Token: 7}, nil
}

func (s *resentClaims) Heartbeat(context.Context, Key, uint64, time.Duration) error {
	s.mu.Lock()
	s.heartbeats++
	s.mu.Unlock()
	return storeerr.Unavailable("heartbeat", errors.New("connection reset"))
}
