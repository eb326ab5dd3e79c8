package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// A duplicate whose re-read of the record fails while the original runs
// (its connection was reset, as internal/testkit/faultsuite does to PostgreSQL)
// keeps waiting and gets the original's answer: the wait ends at
// WaitTimeout, not at the first store error.
func TestWaiterRetriesAFailedReread(t *testing.T) {
	waitsThrough(t, &failing{rereads: 1}, 1)
}

// A duplicate whose subscription fails while the original runs (the
// pub/sub connection was reset that moment, as internal/testkit/faultsuite does to
// Redis) subscribes again, keeps waiting and gets the original's answer.
func TestWaiterRetriesAFailedSubscription(t *testing.T) {
	waitsThrough(t, &failing{subscriptions: 2}, 2)
}

// waitsThrough runs a duplicate of a running original on s, lets the
// original finish once the duplicate met n of s's failures, and requires
// that the duplicate got the original's answer.
func waitsThrough(t *testing.T, s *failing, n int) {
	t.Helper()
	ctx := context.Background()
	s.Store = idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	g := idempotency.New(s, idempotency.Options{WaitTimeout: 10 * time.Second})
	k, fp := idempotency.Key{Name: "k"}, idempotency.FingerprintOf("charge", nil)

	started, finish := make(chan struct{}), make(chan struct{})
	original := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			close(started)
			<-finish
			return idempotency.Response{Status: 201, Body: []byte("charged")}, nil
		})
		original <- err
	}()
	<-started
	type answer struct {
		res idempotency.Result
		err error
	}
	duplicate := make(chan answer, 1)
	go func() {
		res, err := g.Do(ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			return idempotency.Response{Status: 500}, nil
		})
		duplicate <- answer{res, err}
	}()
	require.Eventually(t, func() bool { return s.failures() == n }, 10*time.Second, time.Millisecond,
		"the duplicate never met the store's failures")
	close(finish)
	require.NoError(t, <-original)
	d := <-duplicate
	require.NoError(t, d.err)
	require.True(t, d.res.Replayed)
	require.Equal(t, "charged", string(d.res.Response.Body))
}

// failing fails, with ErrUnavailable as a store whose connection was reset
// does, the first rereads claims of waiters (Watch set) and the first
// subscriptions.
type failing struct {
	idempotency.Store
	mu                     sync.Mutex
	rereads, subscriptions int // the failures still to come
	failed                 int
}

// fail reports whether the call whose failures still to come are left
// fails, and counts it.
func (s *failing) fail(left *int) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if *left == 0 {
		return false
	}
	*left--
	s.failed++
	return true
}

func (s *failing) failures() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.failed
}

func (s *failing) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	if req.Watch && s.fail(&s.rereads) {
		return idempotency.Claim{}, fmt.Errorf("%w: connection reset by peer", idempotency.ErrUnavailable)
	}
	return s.Store.Claim(ctx, req)
}

func (s *failing) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	if s.fail(&s.subscriptions) {
		return nil, fmt.Errorf("%w: subscribe: EOF", idempotency.ErrUnavailable)
	}
	return s.Store.Subscribe(ctx, k)
}
