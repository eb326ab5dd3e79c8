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
// (its connection was reset, as internal/faultsuite does to PostgreSQL)
// keeps waiting and gets the original's answer: the wait ends at
// WaitTimeout, not at the first store error.
func TestWaiterRetriesAFailedReread(t *testing.T) {
	ctx := context.Background()
	store := &failingRereads{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), left: 1}
	g := idempotency.New(store, idempotency.Options{WaitTimeout: 10 * time.Second})
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
	require.Eventually(t, func() bool { return store.failed() == 1 }, 10*time.Second, time.Millisecond,
		"the duplicate's re-read never failed")
	close(finish)
	require.NoError(t, <-original)
	d := <-duplicate
	require.NoError(t, d.err)
	require.True(t, d.res.Replayed)
	require.Equal(t, "charged", string(d.res.Response.Body))
}

// A duplicate whose subscription fails while the original runs (the
// pub/sub connection was reset that moment, as internal/faultsuite does to
// Redis) subscribes again, keeps waiting and gets the original's answer.
func TestWaiterRetriesAFailedSubscription(t *testing.T) {
	ctx := context.Background()
	store := &failingSubscriptions{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), left: 2}
	g := idempotency.New(store, idempotency.Options{WaitTimeout: 10 * time.Second})
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
	duplicate := make(chan error, 1)
	var res idempotency.Result
	go func() {
		var err error
		res, err = g.Do(ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			return idempotency.Response{Status: 500}, nil
		})
		duplicate <- err
	}()
	require.Eventually(t, func() bool { _, waiting := g.InFlight(); return waiting == 1 && store.failed() == 2 }, 10*time.Second, time.Millisecond,
		"the duplicate's subscriptions never failed")
	close(finish)
	require.NoError(t, <-original)
	require.NoError(t, <-duplicate)
	require.True(t, res.Replayed)
	require.Equal(t, "charged", string(res.Response.Body))
}

// failingSubscriptions fails the first left subscriptions with
// ErrUnavailable, as a store whose pub/sub connection was reset does.
type failingSubscriptions struct {
	idempotency.Store
	mu         sync.Mutex
	left, done int
}

func (s *failingSubscriptions) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	s.mu.Lock()
	fail := s.left > 0
	if fail {
		s.left--
		s.done++
	}
	s.mu.Unlock()
	if fail {
		return nil, fmt.Errorf("%w: subscribe: EOF", idempotency.ErrUnavailable)
	}
	return s.Store.Subscribe(ctx, k)
}

func (s *failingSubscriptions) failed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done
}

// failingRereads fails the first left claims of waiters (Watch set) with
// ErrUnavailable, as a store whose connection was reset does.
type failingRereads struct {
	idempotency.Store
	mu         sync.Mutex
	left, done int
}

func (s *failingRereads) Claim(ctx context.Context, req idempotency.ClaimRequest) (idempotency.Claim, error) {
	s.mu.Lock()
	fail := req.Watch && s.left > 0
	if fail {
		s.left--
		s.done++
	}
	s.mu.Unlock()
	if fail {
		return idempotency.Claim{}, fmt.Errorf("%w: connection reset by peer", idempotency.ErrUnavailable)
	}
	return s.Store.Claim(ctx, req)
}

func (s *failingRereads) failed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done
}
