package idempotency

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An operation that runs for several leases keeps its record: every other
// claim meanwhile finds it in flight. Renewals stop when Do returns.
func TestHeartbeatKeepsTheRecord(t *testing.T) {
	const lease = 300 * time.Millisecond
	mem := NewMemoryStore(MemoryOptions{})
	var beats atomic.Int32
	s := &faultStore{Store: mem, hook: func(_ context.Context, op string) error {
		if op == "heartbeat" {
			beats.Add(1)
		}
		return nil
	}}
	g := New(s, Options{Lease: lease})
	k, fp := Key{Name: "long"}, FingerprintOf("op", nil)
	ctx := context.Background()

	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			close(started)
			select {
			case <-release:
				return Response{Status: 201}, nil
			case <-ctx.Done():
				return Response{}, context.Cause(ctx)
			}
		})
		done <- err
	}()
	<-started
	// Four leases: without renewals the record would be taken over.
	for end := time.Now().Add(4 * lease); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		c, err := mem.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "other", Lease: lease, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, InFlight, c.State, "a claim while the owner renews its lease")
	}
	close(release)
	require.NoError(t, <-done)
	after := beats.Load()
	assert.GreaterOrEqual(t, after, int32(4), "renewals over four leases")

	time.Sleep(lease) // three renewal periods
	assert.Equal(t, after, beats.Load(), "renewals after Do returned")
}

// When every renewal fails, the owner gives up once Lease - margin has passed
// since its claim was sent, not before: one failure is not a loss. fn's
// context is cancelled with ErrFenced, naming the renewals' failure, and
// nothing is stored.
func TestHeartbeatGivesUpWhenRenewalsFail(t *testing.T) {
	const lease = 150 * time.Millisecond
	var completes atomic.Int32
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
		switch op {
		case "heartbeat":
			return unavailable("heartbeat", errInjected)
		case "complete":
			completes.Add(1)
		}
		return nil
	}}
	g := New(s, Options{Lease: lease})
	start := time.Now()
	var cause error
	var doneAfter time.Duration
	_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(ctx context.Context) (Response, error) {
		select {
		case <-ctx.Done():
			doneAfter, cause = time.Since(start), context.Cause(ctx)
		case <-time.After(10 * time.Second):
		}
		return Response{Status: 201}, nil
	})
	assert.ErrorIs(t, cause, ErrFenced)
	assert.ErrorIs(t, cause, errInjected, "the cause names the renewals' failure")
	assert.ErrorIs(t, err, ErrFenced)
	assert.GreaterOrEqual(t, doneAfter, lease-leaseMargin(lease), "gave up before its local lease ended")
	assert.Less(t, doneAfter, lease, "still running when the store's lease may have run out")
	assert.Zero(t, completes.Load(), "an outcome was stored after the lease was lost")
}

// hang blocks a store call until its context is done, or, with forever,
// until the test ends: a silent connection, seen by a client that honours
// deadlines or by one that does not.
func hang(t *testing.T, ctx context.Context, forever bool) error {
	if forever {
		<-t.Context().Done()
		return unavailable("hung", t.Context().Err())
	}
	<-ctx.Done()
	return unavailable("hung", ctx.Err())
}

// A renewal that never returns holds Do only for a few round trips (the
// wait that lets the outcome share the renewal's connection): fn returns,
// its outcome is stored, and Do returns.
func TestHeartbeatHungRenewalDoesNotHoldDo(t *testing.T) {
	const lease = 300 * time.Millisecond
	for _, forever := range []bool{false, true} {
		t.Run(map[bool]string{false: "until its deadline", true: "for ever"}[forever], func(t *testing.T) {
			entered := make(chan struct{})
			var once sync.Once
			var hctx context.Context
			mem := NewMemoryStore(MemoryOptions{})
			s := &faultStore{Store: mem, hook: func(ctx context.Context, op string) error {
				if op != "heartbeat" {
					return nil
				}
				once.Do(func() { hctx = ctx; close(entered) })
				return hang(t, ctx, forever)
			}}
			g := New(s, Options{Lease: lease})
			k := Key{Name: "k"}
			var returned time.Time
			res, err := g.Do(context.Background(), k, FingerprintOf("op", nil), func(context.Context) (Response, error) {
				<-entered
				returned = time.Now()
				return Response{Status: 201}, nil
			})
			require.NoError(t, err)
			assert.Less(t, time.Since(returned), lease/6, "Do waited for the hung renewal")
			assert.Equal(t, 201, res.Response.Status)
			d, ok := hctx.Deadline()
			assert.True(t, ok, "a renewal was sent without a deadline")
			assert.WithinDuration(t, returned, d, lease, "the renewal's deadline is not the lease's local end")
			c, err := mem.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: FingerprintOf("op", nil), OperationID: "again", Lease: lease, Retention: time.Hour})
			require.NoError(t, err)
			assert.Equal(t, Completed, c.State, "the outcome was not stored")
		})
	}
}

// A store that stops answering altogether: fn's context is done within
// Lease - margin of the claim's sending, and Do returns right after fn, even
// when the store call never returns; a completion that the store does not
// confirm before the lease's local end is reported as ErrUnavailable at that
// end, not when the store gives up.
func TestSilentStoreEndsTheLeaseOnTime(t *testing.T) {
	const lease = 200 * time.Millisecond
	for _, forever := range []bool{false, true} {
		name := map[bool]string{false: "calls end at their deadline", true: "calls never end"}[forever]
		t.Run(name+"/while fn runs", func(t *testing.T) {
			var silent atomic.Bool
			s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(ctx context.Context, op string) error {
				if silent.Load() {
					return hang(t, ctx, forever)
				}
				return nil
			}}
			g := New(s, Options{Lease: lease})
			sent := time.Now()
			var doneAfter time.Duration
			_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(ctx context.Context) (Response, error) {
				silent.Store(true)
				select {
				case <-ctx.Done():
					doneAfter = time.Since(sent)
				case <-time.After(10 * time.Second):
				}
				return Response{Status: 201}, nil
			})
			returned := time.Since(sent)
			assert.ErrorIs(t, err, ErrFenced)
			assert.Less(t, doneAfter, lease, "fn's context outlived the lease")
			assert.GreaterOrEqual(t, doneAfter, lease-leaseMargin(lease), "fn's context ended before the lease's local end")
			assert.Less(t, returned-doneAfter, 50*time.Millisecond, "Do did not return when fn did")
		})
		t.Run(name+"/while completing", func(t *testing.T) {
			s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(ctx context.Context, op string) error {
				if op == "complete" {
					return hang(t, ctx, forever)
				}
				return nil
			}}
			g := New(s, Options{Lease: lease})
			sent := time.Now()
			_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(ctx context.Context) (Response, error) {
				return Response{Status: 201}, nil
			})
			returned := time.Since(sent)
			assert.ErrorIs(t, err, ErrUnavailable)
			assert.Less(t, returned, lease, "Do outlived the lease")
			assert.GreaterOrEqual(t, returned, lease-leaseMargin(lease)-5*time.Millisecond, "Do gave up on the completion early")
		})
	}
}

// A claim that the store confirms only after the lease it started would have
// run out is not acted on: fn does not run, Do fails with ErrUnavailable, and
// the record is given back, so that the next claim owns it at once, as the
// record's maker (nothing ran).
func TestLateClaimIsGivenBack(t *testing.T) {
	const lease = 100 * time.Millisecond
	mem := NewMemoryStore(MemoryOptions{})
	var slow atomic.Bool
	slow.Store(true)
	// Delayed on its way to the store: applied, and so leased, a whole
	// lease after it was sent.
	s := &faultStore{Store: mem, hook: func(_ context.Context, op string) error {
		if op == "claim" && slow.Swap(false) {
			time.Sleep(lease)
		}
		return nil
	}}
	g := New(s, Options{Lease: lease})
	k, fp := Key{Name: "late"}, FingerprintOf("op", nil)
	_, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
		t.Error("fn ran on a claim confirmed after its lease")
		return Response{}, nil
	})
	require.ErrorIs(t, err, ErrUnavailable)
	require.ErrorIs(t, err, errLateClaim)
	require.Eventually(t, func() bool {
		c, err := mem.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: fp, OperationID: "next", Lease: time.Hour, Retention: time.Hour})
		return err == nil && c.State == Owner && c.Attempt == 1 && c.OperationID == "next"
	}, time.Second, 5*time.Millisecond, "the late claim's record was not given back")
}

// A handler tells a lost lease from a caller gone by its context's cause:
// ErrFenced for the first (see TestHeartbeatGivesUpWhenRenewalsFail), the
// caller's own cause for the second.
func TestCallerGoneIsNotALostLease(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	gone := errors.New("client gone")
	var cause error
	_, err := New(NewMemoryStore(MemoryOptions{}), Options{}).Do(ctx, Key{Name: "k"}, FingerprintOf("op", nil),
		func(ctx context.Context) (Response, error) {
			cancel(gone)
			<-ctx.Done()
			cause = context.Cause(ctx)
			return Response{}, cause
		})
	assert.ErrorIs(t, cause, gone)
	assert.NotErrorIs(t, cause, ErrFenced, "the caller's cancellation reads as a lost lease")
	assert.ErrorIs(t, err, gone)
	assert.NotErrorIs(t, err, ErrFenced)
}
