package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
)

const testLease = 300 * time.Millisecond

// abandon makes k's record abandoned: an owner claims it and stops, and its
// lease runs out. It returns the abandoned claim.
func abandon(t *testing.T, h idempotencytest.Harness, k idempotency.Key, fp idempotency.Fingerprint) idempotency.Claim {
	t.Helper()
	c, err := h.Store.Claim(context.Background(), idempotency.ClaimRequest{Key: k, Fingerprint: fp,
		OperationID: "op_" + k.Name, Lease: testLease, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, c.State)
	pass(h, testLease+50*time.Millisecond)
	return c
}

// pass lets d go by on the store's clock.
func pass(h idempotencytest.Harness, d time.Duration) {
	if h.Advance != nil {
		h.Advance(d)
		return
	}
	time.Sleep(d)
}

func eachHarness(t *testing.T, f func(t *testing.T, h idempotencytest.Harness)) {
	for name, newHarness := range harnesses() {
		t.Run(name, func(t *testing.T) { f(t, newHarness(t)) })
	}
}

func TestRecoverSettlesAbandonedOperation(t *testing.T) {
	eachHarness(t, func(t *testing.T, h idempotencytest.Harness) {
		var seen string
		g := idempotency.New(h.Store, idempotency.Options{Lease: testLease, Recover: func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			seen = fmt.Sprintf("%s attempt %d abandoned %v takeover %v", info.OperationID, info.Attempt, info.Abandoned, info.Takeover)
			dk, err := idempotency.DownstreamKey(ctx, "gateway")
			return idempotency.Response{Status: 201, Body: []byte("recovered " + dk)}, err
		}})
		k, fp := idempotency.Key{Name: "settle"}, idempotency.FingerprintOf("op", nil)
		abandon(t, h, k, fp)

		ran := false
		r, err := g.Do(context.Background(), k, fp, func(context.Context) (idempotency.Response, error) {
			ran = true
			return idempotency.Response{}, nil
		})
		require.NoError(t, err)
		assert.False(t, ran, "the operation ran again although the hook settled it")
		assert.True(t, r.Replayed)
		assert.Equal(t, "op_settle attempt 2 abandoned true takeover true", seen)
		want := "recovered " + downstreamKeyOf(t, "op_settle", "gateway")
		assert.Equal(t, want, string(r.Response.Body))

		again, err := g.Do(context.Background(), k, fp, nil)
		require.NoError(t, err)
		assert.True(t, again.Replayed)
		assert.Equal(t, want, string(again.Response.Body))
	})
}

// downstreamKeyOf is DownstreamKey for an operation ID, read inside a Do.
func downstreamKeyOf(t *testing.T, operationID, name string) string {
	s := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	_, err := s.Claim(context.Background(), idempotency.ClaimRequest{Key: idempotency.Key{Name: "k"}, OperationID: operationID, Lease: time.Millisecond, Retention: time.Hour})
	require.NoError(t, err)
	time.Sleep(2 * time.Millisecond)
	var key string
	_, err = idempotency.New(s, idempotency.Options{}).Do(context.Background(), idempotency.Key{Name: "k"}, idempotency.Fingerprint{}, func(ctx context.Context) (idempotency.Response, error) {
		var err error
		key, err = idempotency.DownstreamKey(ctx, name)
		return idempotency.Response{}, err
	})
	require.NoError(t, err)
	return key
}

func TestRecoverReleaseRunsOperation(t *testing.T) {
	eachHarness(t, func(t *testing.T, h idempotencytest.Harness) {
		g := idempotency.New(h.Store, idempotency.Options{Lease: testLease, Recover: func(ctx context.Context) (idempotency.Response, error) {
			idempotency.SetDisposition(ctx, idempotency.Release) // the provider never saw it
			return idempotency.Response{}, nil
		}})
		k, fp := idempotency.Key{Name: "release"}, idempotency.FingerprintOf("op", nil)
		abandon(t, h, k, fp)
		r, err := g.Do(context.Background(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			return idempotency.Response{Status: 201, Body: fmt.Appendf(nil, "attempt %d abandoned %v", info.Attempt, info.Abandoned)}, nil
		})
		require.NoError(t, err)
		assert.False(t, r.Replayed)
		assert.Equal(t, "attempt 2 abandoned true", string(r.Response.Body))
	})
}

func TestRecoverUnknownLeavesRecordAbandoned(t *testing.T) {
	eachHarness(t, func(t *testing.T, h idempotencytest.Harness) {
		var calls atomic.Int32
		known := false
		g := idempotency.New(h.Store, idempotency.Options{Lease: testLease, Recover: func(ctx context.Context) (idempotency.Response, error) {
			calls.Add(1)
			if !known {
				return idempotency.Response{}, idempotency.ErrUnknown
			}
			return idempotency.Response{Status: 200, Body: []byte("found")}, nil
		}})
		k, fp := idempotency.Key{Name: "unknown"}, idempotency.FingerprintOf("op", nil)
		abandon(t, h, k, fp)
		fn := func(context.Context) (idempotency.Response, error) {
			t.Error("the operation ran while its outcome was unknown")
			return idempotency.Response{}, nil
		}
		_, err := g.Do(context.Background(), k, fp, fn)
		require.ErrorIs(t, err, idempotency.ErrInFlight)
		require.ErrorIs(t, err, idempotency.ErrUnknown)

		// Claimable again at once, and still abandoned: the hook runs again.
		known = true
		r, err := g.Do(context.Background(), k, fp, fn)
		require.NoError(t, err)
		assert.Equal(t, "found", string(r.Response.Body))
		assert.Equal(t, int32(2), calls.Load())
	})
}

func TestSweepSettlesWithoutClient(t *testing.T) {
	eachHarness(t, func(t *testing.T, h idempotencytest.Harness) {
		var mu sync.Mutex
		recovered := map[string]int{}
		recoverFn := func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			mu.Lock()
			recovered[info.OperationID]++
			mu.Unlock()
			if info.OperationID == "op_never-charged" {
				idempotency.SetDisposition(ctx, idempotency.Release)
				return idempotency.Response{}, nil
			}
			return idempotency.Response{Status: 201, Body: []byte(info.OperationID)}, nil
		}
		opts := idempotency.Options{Lease: time.Minute, Recover: recoverFn}
		ctx := context.Background()
		fp := idempotency.FingerprintOf("op", nil)

		// Abandoned records, for two racing sweepers to settle.
		const n = 20
		for i := range n {
			_, err := h.Store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Scope: "s", Name: fmt.Sprint("abandoned-", i)},
				Fingerprint: fp, OperationID: fmt.Sprint("op_abandoned-", i), Lease: testLease, Retention: time.Hour})
			require.NoError(t, err)
		}
		abandon(t, h, idempotency.Key{Name: "never-charged"}, fp)
		// Records a sweep must not touch: live, completed, released.
		live, err := h.Store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: "live"}, Fingerprint: fp, OperationID: "op_live", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		done, err := h.Store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: "done"}, Fingerprint: fp, OperationID: "op_done", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		require.NoError(t, h.Store.Complete(ctx, idempotency.Key{Name: "done"}, done.Token, idempotency.Response{Status: 200, Body: []byte("done")}, time.Hour))
		rel, err := h.Store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: "released"}, Fingerprint: fp, OperationID: "op_released", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		require.NoError(t, h.Store.Release(ctx, idempotency.Key{Name: "released"}, rel.Token))

		var settled atomic.Int32
		var wg sync.WaitGroup
		for range 2 {
			g := idempotency.New(h.Store, opts)
			wg.Go(func() {
				for {
					got, err := g.Sweep(ctx, 7)
					assert.NoError(t, err)
					if got == 0 {
						return
					}
					settled.Add(int32(got))
				}
			})
		}
		wg.Wait()
		assert.Equal(t, int32(n+1), settled.Load())
		mu.Lock()
		for op, calls := range recovered {
			assert.Equal(t, 1, calls, "%s recovered %d times", op, calls)
		}
		assert.Len(t, recovered, n+1)
		assert.NotContains(t, recovered, "op_live")
		assert.NotContains(t, recovered, "op_done")
		assert.NotContains(t, recovered, "op_released")
		mu.Unlock()

		g := idempotency.New(h.Store, opts)
		for i := range n {
			r, err := g.Do(ctx, idempotency.Key{Scope: "s", Name: fmt.Sprint("abandoned-", i)}, fp, nil)
			require.NoError(t, err)
			assert.Equal(t, fmt.Sprint("op_abandoned-", i), string(r.Response.Body))
		}
		// The record whose operation never happened is free for its retry.
		r, err := g.Do(ctx, idempotency.Key{Name: "never-charged"}, fp, func(ctx context.Context) (idempotency.Response, error) {
			return idempotency.Response{Status: 201, Body: []byte("charged now")}, nil
		})
		require.NoError(t, err)
		assert.Equal(t, "charged now", string(r.Response.Body))
		// The live owner still owns its record.
		assert.NoError(t, h.Store.Heartbeat(ctx, idempotency.Key{Name: "live"}, live.Token, time.Hour))
		c, err := h.Store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Name: "released"}, Fingerprint: fp, OperationID: "x", Lease: time.Hour, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, idempotency.Owner, c.State)
		assert.False(t, c.Abandoned, "a swept released record must stay released")
	})
}

func TestSweepNeedsRecover(t *testing.T) {
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	_, err := g.Sweep(context.Background(), 0)
	assert.Error(t, err)
}

// A handler that outlives several leases keeps its record through renewals;
// a duplicate meanwhile waits instead of taking over.
func TestHeartbeatKeepsOwnership(t *testing.T) {
	for name, newHarness := range harnesses() {
		t.Run(name, func(t *testing.T) {
			h := newHarness(t)
			if h.Advance != nil {
				t.Skip("renewals run on real time; the real-time stores cover this")
			}
			g := idempotency.New(h.Store, idempotency.Options{Lease: testLease, RecheckInterval: 50 * time.Millisecond})
			k, fp := idempotency.Key{Name: "long"}, idempotency.FingerprintOf("op", nil)
			var runs atomic.Int32
			fn := func(ctx context.Context) (idempotency.Response, error) {
				runs.Add(1)
				select {
				case <-time.After(5 * testLease):
				case <-ctx.Done():
					return idempotency.Response{}, context.Cause(ctx)
				}
				return idempotency.Response{Status: 201, Body: []byte("long")}, nil
			}
			var wg sync.WaitGroup
			for range 3 {
				wg.Go(func() {
					r, err := g.Do(context.Background(), k, fp, fn)
					assert.NoError(t, err)
					assert.Equal(t, "long", string(r.Response.Body))
				})
				time.Sleep(testLease)
			}
			wg.Wait()
			assert.Equal(t, int32(1), runs.Load())
		})
	}
}

// An owner whose renewal is refused, because another took over, sees its
// context cancelled with ErrFenced, and its outcome is not stored.
func TestFencedOwnerIsCancelled(t *testing.T) {
	eachHarness(t, func(t *testing.T, h idempotencytest.Harness) {
		g := idempotency.New(h.Store, idempotency.Options{Lease: testLease})
		k, fp := idempotency.Key{Name: "fenced"}, idempotency.FingerprintOf("op", nil)
		var cause error
		_, err := g.Do(context.Background(), k, fp, func(ctx context.Context) (idempotency.Response, error) {
			info, _ := idempotency.FromContext(ctx)
			// The record changes hands under the running owner: its token
			// is no longer current once the key is forgotten and claimed anew.
			require.NoError(t, h.Store.Forget(context.Background(), k, info.Token))
			_, err := h.Store.Claim(context.Background(), idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "other", Lease: time.Hour, Retention: time.Hour})
			require.NoError(t, err)
			<-ctx.Done()
			cause = context.Cause(ctx)
			return idempotency.Response{Status: 201}, nil
		})
		assert.ErrorIs(t, cause, idempotency.ErrFenced)
		assert.ErrorIs(t, err, idempotency.ErrFenced)
		assert.False(t, errors.Is(err, idempotency.ErrInFlight))
	})
}
