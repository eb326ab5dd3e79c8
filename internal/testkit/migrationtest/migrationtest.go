// Package migrationtest checks the store of idempotency.NewMigratingStore between two real
// stores. Only this module's own tests use it (the memory store to Redis,
// PostgreSQL to Redis), so it is kept out of the public API.
package migrationtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// Run checks NewMigratingStore from old to new, as a service moves from one
// store to the other, in subtests of t:
//
//   - HonoursOldRecords: a record old already holds is honoured through the
//     migrating store. A completed one is replayed, without running the
//     operation again, and copied to new; a request with another fingerprint
//     is refused with ErrMismatch; one in flight is waited for and then
//     replayed; a released one runs again as attempt 2 under its operation ID.
//   - NewKeys/DualWrite=false and NewKeys/DualWrite=true: concurrent callers
//     of a key neither store holds run its operation once. The record lands in
//     new; with DualWrite it lands in old too, so that instances still on old
//     alone, calling while the operation runs, wait for it instead of running
//     it again; without DualWrite old has no record of the key.
//
// Every key is unique to the run, so old and new may be shared with other
// tests.
func Run(t *testing.T, old, new idempotency.Store) {
	t.Run("HonoursOldRecords", func(t *testing.T) { migrationHonoursOld(t, old, new) })
	for _, dual := range []bool{false, true} {
		t.Run(fmt.Sprintf("NewKeys/DualWrite=%v", dual), func(t *testing.T) { migrationNewKeys(t, old, new, dual) })
	}
}

func migrationHonoursOld(t *testing.T, old, new idempotency.Store) {
	ctx := context.Background()
	id := rand.Uint64()
	key := func(name string) idempotency.Key {
		return idempotency.Key{Scope: t.Name(), Name: fmt.Sprintf("%s-%d", name, id)}
	}
	fp := idempotency.FingerprintOf("charge", []byte(`{"amount":1}`))
	before := idempotency.New(old, idempotency.Options{})
	after := idempotency.New(idempotency.NewMigratingStore(old, new, idempotency.MigrationOptions{}),
		idempotency.Options{WaitTimeout: 300 * time.Millisecond, RecheckInterval: 50 * time.Millisecond})
	never := func(context.Context) (idempotency.Response, error) {
		t.Error("an operation the old store knows ran again")
		return idempotency.Response{}, errors.New("ran again")
	}

	// Completed before the switch: replayed after it, and moved over.
	done, err := before.Do(ctx, key("done"), fp, func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{Status: 201, Body: []byte("charged")}, nil
	})
	require.NoError(t, err)
	r, err := after.Do(ctx, key("done"), fp, never)
	require.NoError(t, err)
	assert.True(t, r.Replayed)
	assert.Equal(t, "charged", string(r.Response.Body))
	assert.Equal(t, done.OperationID, r.OperationID)
	c, err := new.Claim(ctx, idempotency.ClaimRequest{Key: key("done"), Fingerprint: fp, OperationID: "x", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, idempotency.Completed, c.State, "the replayed record is in the new store now")

	// A different request under an old key: mismatch.
	_, err = after.Do(ctx, key("done"), idempotency.FingerprintOf("charge", []byte(`{"amount":2}`)), never)
	assert.ErrorIs(t, err, idempotency.ErrMismatch)
	_, err = before.Do(ctx, key("other"), fp, func(context.Context) (idempotency.Response, error) {
		return idempotency.Response{Status: 201}, nil
	})
	require.NoError(t, err)
	_, err = after.Do(ctx, key("other"), idempotency.FingerprintOf("charge", []byte(`{"amount":2}`)), never)
	assert.ErrorIs(t, err, idempotency.ErrMismatch)

	// In flight in the old store: waited for, then replayed.
	running, err := old.Claim(ctx, idempotency.ClaimRequest{Key: key("running"), Fingerprint: fp, OperationID: "op_running", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	_, err = after.Do(ctx, key("running"), fp, never)
	assert.ErrorIs(t, err, idempotency.ErrInFlight)
	waited := make(chan idempotency.Result, 1)
	go func() {
		after := idempotency.New(idempotency.NewMigratingStore(old, new, idempotency.MigrationOptions{}), idempotency.Options{WaitTimeout: 10 * time.Second})
		r, err := after.Do(ctx, key("running"), fp, never)
		assert.NoError(t, err)
		waited <- r
	}()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, old.Complete(ctx, key("running"), running.Token, idempotency.Response{Status: 201, Body: []byte("late")}, time.Hour))
	select {
	case r := <-waited:
		assert.Equal(t, "late", string(r.Response.Body))
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not see the old store's completion")
	}

	// Released in the old store: runs again with the old operation ID.
	var firstOp string
	_, err = before.Do(ctx, key("failed"), fp, func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		firstOp = info.OperationID
		return idempotency.Response{}, errors.New("gateway timeout")
	})
	require.Error(t, err)
	r, err = after.Do(ctx, key("failed"), fp, func(ctx context.Context) (idempotency.Response, error) {
		info, _ := idempotency.FromContext(ctx)
		assert.Equal(t, firstOp, info.OperationID, "the retry must keep the operation ID")
		assert.Equal(t, 2, info.Attempt)
		return idempotency.Response{Status: 201, Body: []byte("retried")}, nil
	})
	require.NoError(t, err)
	assert.Equal(t, "retried", string(r.Response.Body))
}

// migrationNewKeys sends the same new keys through instances on the
// migrating store and, with DualWrite (as during a rolling deploy), through
// instances still on the old store alone, the latter arriving while the
// operation runs on a migrating instance: each operation runs once, and its
// record lands where it should.
func migrationNewKeys(t *testing.T, old, new idempotency.Store, dual bool) {
	ctx := context.Background()
	fp := idempotency.FingerprintOf("charge", nil)
	migrating := idempotency.New(idempotency.NewMigratingStore(old, new, idempotency.MigrationOptions{DualWrite: dual}),
		idempotency.Options{RecheckInterval: 20 * time.Millisecond})
	oldOnly := idempotency.New(old, idempotency.Options{RecheckInterval: 20 * time.Millisecond})
	const keys, callers = 5, 4
	for i := range keys {
		k := idempotency.Key{Scope: t.Name(), Name: fmt.Sprintf("new-%d-%d", i, rand.Uint64())}
		var runs atomic.Int32
		running, proceed := make(chan struct{}), make(chan struct{})
		var once sync.Once
		fn := func(context.Context) (idempotency.Response, error) {
			runs.Add(1)
			once.Do(func() { close(running) })
			<-proceed
			return idempotency.Response{Status: 201, Body: []byte(k.Name)}, nil
		}
		var wg sync.WaitGroup
		call := func(g *idempotency.Guard) {
			wg.Go(func() {
				r, err := g.Do(ctx, k, fp, fn)
				if assert.NoError(t, err) {
					assert.Equal(t, k.Name, string(r.Response.Body))
				}
			})
		}
		for range callers {
			call(migrating)
		}
		<-running
		if dual {
			for range callers {
				call(oldOnly)
			}
		}
		time.Sleep(50 * time.Millisecond) // let the late callers reach their stores
		close(proceed)
		wg.Wait()
		assert.Equal(t, int32(1), runs.Load(), "key %d ran %d times", i, runs.Load())

		c, err := new.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "x", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, idempotency.Completed, c.State, "a new key lands in the new store")
		o, err := old.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "x", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		if dual {
			assert.Equal(t, idempotency.Completed, o.State, "with DualWrite, old-only instances see new keys")
		} else {
			assert.Equal(t, idempotency.Owner, o.State, "without DualWrite, new keys stay out of the old store")
			assert.Equal(t, 1, o.Attempt)
		}
	}
}
