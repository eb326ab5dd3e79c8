package idempotencytest_test

import (
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/stretchr/testify/require"
)

// fakeClock is a MemoryStore clock that moves only when told to.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Date(2030, time.January, 1, 0, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

func TestMemoryStoreFakeClock(t *testing.T) {
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		clock := newFakeClock()
		return idempotencytest.Harness{
			Store:   idempotency.NewMemoryStore(idempotency.MemoryOptions{Now: clock.Now}),
			Advance: clock.Advance,
		}
	})
}

// TestMemoryStoreRealTime shares one store between the cases, as a store
// backed by one server does.
func TestMemoryStoreRealTime(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: store}
	})
}

func TestMemoryStoreMaxRecords(t *testing.T) {
	ctx := t.Context()
	clock := newFakeClock()
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{MaxRecords: 2, Now: clock.Now})
	fp := idempotency.FingerprintOf("test", nil)
	claim := func(name string) (idempotency.Claim, error) {
		return store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: name}, Fingerprint: fp,
			OperationID: "op-" + name, Lease: time.Hour, Retention: 24 * time.Hour})
	}
	owned := func(name string) idempotency.Claim {
		t.Helper()
		c, err := claim(name)
		require.NoError(t, err, "claim %s", name)
		require.Equal(t, idempotency.Owner, c.State, "claim %s: state", name)
		require.Equal(t, 1, c.Attempt, "claim %s: attempt", name)
		return c
	}

	done := owned("done")
	owned("live")
	_, err := claim("third")
	require.ErrorIs(t, err, idempotency.ErrUnavailable, "a new record in a store full of live records")

	// Records already held are still served when the store is full.
	c, err := claim("live")
	require.NoError(t, err, "claim of a held record in a full store")
	require.Equal(t, idempotency.InFlight, c.State, "claim of a held record in a full store")

	resp := idempotency.Response{Status: 201, Body: []byte("done")}
	require.NoError(t, store.Complete(ctx, idempotency.Key{Name: "done"}, done.Token, resp, time.Minute))
	clock.Advance(2 * time.Minute)
	owned("third") // room made by dropping the expired record

	c, err = claim("live")
	require.NoError(t, err, "claim of the live record after the drop")
	require.Equal(t, idempotency.InFlight, c.State, "the live record must survive the drop")
	_, err = claim("done")
	require.ErrorIs(t, err, idempotency.ErrUnavailable, "the dropped record's key, in a store full again")
}
