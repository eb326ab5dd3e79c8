package idempotency_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/idempotency-go/idempotency"
)

// slowCompleteStore is what a user writes to add one step to a store's
// Complete (an audit write, a metric pushed over the network): it embeds
// the store, so every other method, and any unexported one, is promoted.
// Its Complete does not end by its context's deadline.
type slowCompleteStore struct {
	*idempotency.MemoryStore
	unblock chan struct{}
}

func (s slowCompleteStore) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	<-s.unblock
	return s.MemoryStore.Complete(ctx, k, token, resp, retention)
}

// A store that embeds one of this package's stores but replaces a call is
// not one of this package's stores: the Guard must not trust the embedded
// store's word that every call ends by its deadline, and Do still returns
// at the lease's local end with ErrUnavailable.
func TestWrappedStoreSettleEndsOnTime(t *testing.T) {
	const lease = 500 * time.Millisecond
	s := slowCompleteStore{MemoryStore: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), unblock: make(chan struct{})}
	t.Cleanup(func() { close(s.unblock) }) // lets the wrapper's Complete end
	g := idempotency.New(s, idempotency.Options{Lease: lease})
	start := time.Now()
	_, err := g.Do(context.Background(), idempotency.Key{Name: t.Name()}, idempotency.FingerprintOf("op", nil), func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{Status: 201}, nil
	})
	returned := time.Since(start)
	assert.ErrorIs(t, err, idempotency.ErrUnavailable)
	// Do returns at the lease's local end, give or take the scheduler: a
	// Guard that waited for the wrapper's Complete would not return before
	// the test ends, which is what unblocks it.
	assert.Less(t, returned, 2*lease, "Do outlived the lease: the Guard waited for the wrapper's Complete on the caller's goroutine")
}
