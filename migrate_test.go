package idempotency

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// During a rolling deploy (DualWrite), an owner on the migrating store whose
// completion reaches only one of the two stores must not leave the two
// kinds of instance with different answers: the old store, which instances
// still on it read alone, lets its record lapse and a retry there runs the
// operation and answers; every later retry, on either kind of instance,
// must get that answer back, not an outcome nobody was answered.
func TestMigratingCompleteReachesOldFirst(t *testing.T) {
	const lease = 200 * time.Millisecond
	oldMem, newMem := NewMemoryStore(MemoryOptions{}), NewMemoryStore(MemoryOptions{})
	var failOld atomic.Bool
	old := &faultStore{Store: oldMem, hook: func(_ context.Context, op string) error {
		if op == "complete" && failOld.CompareAndSwap(true, false) {
			return storeerr.Unavailable("complete", errInjected)
		}
		return nil
	}}
	migrating := New(NewMigratingStore(old, newMem, MigrationOptions{DualWrite: true}), Options{Lease: lease, WaitTimeout: -1})
	oldOnly := New(oldMem, Options{Lease: lease, WaitTimeout: -1})
	k, fp := Key{Name: "charge"}, FingerprintOf("op", nil)
	var runs atomic.Int32
	run := func(body string) func(context.Context) (Response, error) {
		return func(context.Context) (Response, error) {
			runs.Add(1)
			return Response{Status: 201, Body: []byte(body)}, nil
		}
	}

	failOld.Store(true)
	_, err := migrating.Do(t.Context(), k, fp, run("first"))
	require.ErrorIs(t, err, ErrUnavailable, "the old store did not take the outcome")

	time.Sleep(lease + 100*time.Millisecond) // the old store's record lapses
	answered, err := oldOnly.Do(t.Context(), k, fp, run("second"))
	require.NoError(t, err, "a retry on an instance still on the old store")
	t.Logf("runs: %d; answered by the old-only instance: %q (replayed %v)", runs.Load(), answered.Response.Body, answered.Replayed)

	time.Sleep(lease + 100*time.Millisecond)
	again, err := migrating.Do(t.Context(), k, fp, run("third"))
	require.NoError(t, err, "a retry on a migrating instance")
	assert.Equal(t, string(answered.Response.Body), string(again.Response.Body),
		"a migrating instance replays an outcome other than the one answered")
	assert.True(t, again.Replayed)
}
