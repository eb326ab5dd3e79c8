package idempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/storeerr"
	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
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
	const lease = 400 * time.Millisecond
	var completes atomic.Int32
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
		switch op {
		case "heartbeat":
			return storeerr.Unavailable("heartbeat", errInjected)
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
		return storeerr.Unavailable("hung", t.Context().Err())
	}
	<-ctx.Done()
	return storeerr.Unavailable("hung", ctx.Err())
}

// A renewal that never returns holds Do only for a few round trips (the
// wait that lets the outcome share the renewal's connection): fn returns,
// its outcome is stored, and Do returns.
func TestHeartbeatHungRenewalDoesNotHoldDo(t *testing.T) {
	// Long enough that the bounds below leave a loaded machine's scheduler
	// room: a Do held by the renewal would return about 600ms after fn.
	const lease = time.Second
	for _, forever := range []bool{false, true} {
		t.Run(map[bool]string{false: "until its deadline", true: "for ever"}[forever], func(t *testing.T) {
			entered := make(chan struct{})
			var once sync.Once
			var hctx context.Context
			var claimed time.Time
			mem := NewMemoryStore(MemoryOptions{})
			s := &faultStore{Store: mem, hook: func(ctx context.Context, op string) error {
				if op == "claim" {
					claimed = time.Now()
				}
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
			// The Guard sent the claim just before the store saw it.
			assert.WithinDuration(t, claimed.Add(lease-leaseMargin(lease)), d, 25*time.Millisecond,
				"the renewal's deadline is not the lease's local end")
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
	// Long enough that the margin (Lease/20) covers a timer fired late on a
	// loaded machine: the bounds below are the lease's, not the scheduler's.
	const lease = time.Second
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

// The same on a redis-server whose link goes silent while the outcome is on
// its way, with go-redis timeouts far past the lease. A client that honours
// deadlines (ContextTimeoutEnabled) ends the completion at the lease's local
// end, on the caller's goroutine; with one that does not, the Guard stops
// waiting for it then. A ReadTimeout of -2 has go-redis set no socket
// deadline at all, the context's neither, so ContextTimeoutEnabled does not
// make such a client honour deadlines. Either way Do fails with
// ErrUnavailable on time.
func TestSilentRedisEndsTheCompletionOnTime(t *testing.T) {
	const lease = time.Second
	srv := testserver.StartRedis(t)
	for _, c := range []struct {
		name    string
		opts    redis.Options
		honours bool
	}{
		{"client honours deadlines", redis.Options{ContextTimeoutEnabled: true, ReadTimeout: time.Minute, WriteTimeout: time.Minute}, true},
		{"client ignores deadlines", redis.Options{ReadTimeout: time.Minute, WriteTimeout: time.Minute}, false},
		{"client sets no socket deadline", redis.Options{ContextTimeoutEnabled: true, ReadTimeout: -2}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := faultproxy.Start(t, srv.Addr)
			c.opts.Addr = p.Addr()
			client := redis.NewClient(&c.opts)
			t.Cleanup(func() { client.Close() })
			s := newRedisStore(t, client)
			assert.Equal(t, c.honours, s.endsByDeadline)
			g := New(s, Options{Lease: lease})
			done := make(chan error, 1)
			sent := time.Now()
			go func() {
				_, err := g.Do(context.Background(), Key{Name: t.Name()}, FingerprintOf("op", nil), func(context.Context) (Response, error) {
					p.Partition()
					return Response{Status: 201}, nil
				})
				done <- err
			}()
			select {
			case err := <-done:
				returned := time.Since(sent)
				assert.ErrorIs(t, err, ErrUnavailable)
				assert.Less(t, returned, lease, "Do outlived the lease")
				assert.GreaterOrEqual(t, returned, lease-leaseMargin(lease)-5*time.Millisecond, "Do gave up on the completion early")
			case <-time.After(3 * lease):
				t.Errorf("Do had not returned %v after it started, %v past the lease", 3*lease, 2*lease)
				p.Heal()
				<-done
			}
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

// With CancelWithCaller, a handler tells a lost lease from a caller gone by
// its context's cause: ErrFenced for the first (see
// TestHeartbeatGivesUpWhenRenewalsFail), the caller's own cause for the
// second.
func TestCallerGoneIsNotALostLease(t *testing.T) {
	ctx, cancel := context.WithCancelCause(context.Background())
	gone := errors.New("client gone")
	var cause error
	_, err := New(NewMemoryStore(MemoryOptions{}), Options{CancelWithCaller: true}).Do(ctx, Key{Name: "k"}, FingerprintOf("op", nil),
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

// A renewal confirmed late extends the lease from when it was sent, not from
// its reply: once the store then falls silent, fn's context ends Lease -
// margin after that renewal was sent.
func TestLateRenewalCountsFromItsSending(t *testing.T) {
	const lease, delay = 300 * time.Millisecond, 150 * time.Millisecond
	var beats atomic.Int32
	var renewalSeen time.Time
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(ctx context.Context, op string) error {
		if op != "heartbeat" {
			return nil
		}
		if beats.Add(1) == 1 {
			renewalSeen = time.Now()
			time.Sleep(delay) // applied, and so confirmed, late
			return nil
		}
		return hang(t, ctx, false)
	}}
	var doneAt time.Time
	_, err := New(s, Options{Lease: lease}).Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil),
		func(ctx context.Context) (Response, error) {
			select {
			case <-ctx.Done():
				doneAt = time.Now()
			case <-time.After(10 * time.Second):
			}
			return Response{}, context.Cause(ctx)
		})
	require.ErrorIs(t, err, ErrFenced)
	end := renewalSeen.Add(lease - leaseMargin(lease))
	assert.False(t, doneAt.After(end.Add(leaseMargin(lease))),
		"fn's context ended %v after the lease of the late renewal, counted from its sending", doneAt.Sub(end))
	assert.True(t, doneAt.After(renewalSeen.Add(lease-leaseMargin(lease)-leaseMargin(lease))),
		"the late renewal did not extend the lease")
}

// A renewal that the store refuses while the operation's outcome waits to
// go out on its connection: nothing is stored, and Do reports ErrFenced.
func TestRenewalRefusedWhileSettling(t *testing.T) {
	// The wait for the renewal in flight is about the margin (Lease/20):
	// long enough here that the renewal's scheduling on a loaded machine
	// stays well within it.
	const lease = 2 * time.Second
	entered := make(chan struct{})
	var once sync.Once
	var completes atomic.Int32
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
		switch op {
		case "heartbeat":
			once.Do(func() { close(entered) })
			time.Sleep(leaseMargin(lease) / 3) // well within the wait for a sound connection
			return ErrFenced
		case "complete":
			completes.Add(1)
		}
		return nil
	}}
	_, err := New(s, Options{Lease: lease}).Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil),
		func(context.Context) (Response, error) {
			<-entered
			return Response{Status: 201}, nil
		})
	assert.ErrorIs(t, err, ErrFenced, "Do did not wait for the renewal in flight")
	assert.Zero(t, completes.Load(), "an outcome was stored although the renewal was refused")
}

// An owner that gives an abandoned record up (its recovery hook could not
// tell what happened) while a renewal is still on its way: the renewal must
// not land after the give-up and take the record back for a lease.
func TestGiveUpOutlastsRenewalInFlight(t *testing.T) {
	const lease = 300 * time.Millisecond
	mem := NewMemoryStore(MemoryOptions{})
	k, fp := Key{Name: "k"}, FingerprintOf("op", nil)
	ctx := context.Background()
	_, err := mem.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "crashed", Lease: time.Millisecond, Retention: time.Hour})
	require.NoError(t, err)
	time.Sleep(5 * time.Millisecond)

	renewing := make(chan struct{})
	var beats atomic.Int32
	s := &faultStore{Store: mem, hook: func(_ context.Context, op string) error {
		if op == "heartbeat" && beats.Add(1) == 1 {
			close(renewing)
			time.Sleep(60 * time.Millisecond) // on a slow link, then applied
		}
		return nil
	}}
	g := New(s, Options{Lease: lease, Recover: func(ctx context.Context) (Response, error) {
		<-renewing
		return Response{}, ErrUnknown
	}})
	_, err = g.Do(ctx, k, fp, func(context.Context) (Response, error) {
		t.Error("ran an operation whose recovery could not tell")
		return Response{}, nil
	})
	require.ErrorIs(t, err, ErrInFlight)
	time.Sleep(100 * time.Millisecond) // past the renewal's landing
	c, err := mem.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "next", Lease: lease, Retention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, Owner, c.State, "the record was taken back by a renewal after the give-up")
	assert.True(t, c.Abandoned, "the record given up is no longer abandoned")
}

// The migrating store's own clean-up calls keep a deadline: a claim whose old
// store fails while the new store no longer answers returns within a lease.
func TestMigratingClaimUndoHasADeadline(t *testing.T) {
	const lease = 200 * time.Millisecond
	old := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: failOn(storeerr.Unavailable("claim", errInjected), "claim")}
	new := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(ctx context.Context, op string) error {
		if op == "release" {
			return hang(t, ctx, false)
		}
		return nil
	}}
	g := New(NewMigratingStore(old, new, MigrationOptions{}), Options{Lease: lease})
	start := time.Now()
	_, err := g.Do(context.Background(), Key{Name: "k"}, FingerprintOf("op", nil), func(context.Context) (Response, error) {
		t.Error("ran although the old store could not be asked")
		return Response{}, nil
	})
	assert.ErrorIs(t, err, ErrUnavailable)
	// Without a deadline the clean-up hangs until the test ends; the second
	// of slack is the scheduler's, on a loaded machine.
	assert.Less(t, time.Since(start), lease+time.Second, "the claim's clean-up had no deadline")
}

// SetDisposition refuses what is not a disposition, so that no operation
// can leave its record neither settled nor renewed.
func TestSetDispositionRefusesUnknown(t *testing.T) {
	g := New(NewMemoryStore(MemoryOptions{}), Options{})
	k, fp := Key{Name: "k"}, FingerprintOf("op", nil)
	_, err := g.Do(context.Background(), k, fp, func(ctx context.Context) (Response, error) {
		assert.False(t, SetDisposition(ctx, Disposition(7)), "SetDisposition(7)")
		assert.False(t, SetDisposition(ctx, abandon), "SetDisposition(abandon)")
		return Response{Status: 201}, nil
	})
	require.NoError(t, err)
	res, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
		t.Error("the operation ran again: its outcome was not kept")
		return Response{}, nil
	})
	require.NoError(t, err)
	assert.True(t, res.Replayed, "the outcome was kept")
	assert.Equal(t, 201, res.Response.Status)
}

// A handler whose response is settled early, before it streams, stays bound
// by the lease: when the early settlement fails, or gives the record up
// (a large 5xx releases it), its context ends, with no wait for the handler.
func TestEarlySettlementEndsTheHandlersLease(t *testing.T) {
	const lease = 600 * time.Millisecond
	for _, c := range []struct {
		name   string
		status int
		hook   func(ctx context.Context, op string) error
	}{
		{"completion unconfirmed", http.StatusCreated, func(ctx context.Context, op string) error {
			if op == "complete" {
				return hang(t, ctx, true)
			}
			return nil
		}},
		{"record released", http.StatusBadGateway, func(context.Context, string) error { return nil }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: c.hook}
			done := make(chan error, 1)
			h := New(s, Options{Lease: lease}).Middleware(MiddlewareOptions{Scope: SingleTenant, MaxResponseBytes: 4})(
				http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(c.status)
					_, _ = io.WriteString(w, "more than four bytes")
					select {
					case <-r.Context().Done():
						done <- context.Cause(r.Context())
					case <-time.After(10 * time.Second):
						done <- nil
					}
				}))
			start := time.Now()
			go h.ServeHTTP(httptest.NewRecorder(), keyed("early", "{}"))
			cause := <-done
			require.Error(t, cause, "the handler's context outlived its hold on the record")
			assert.Less(t, time.Since(start), lease, "the handler's context ended after the lease")
		})
	}
}

// FailOpen never runs a handler unguarded on a claim the store took but
// confirmed too late to act on: the record exists, and may be another
// attempt's abandoned one.
func TestFailOpenRefusesLateClaim(t *testing.T) {
	const lease = 100 * time.Millisecond
	s := &faultStore{Store: NewMemoryStore(MemoryOptions{}), hook: func(_ context.Context, op string) error {
		if op == "claim" {
			time.Sleep(lease)
		}
		return nil
	}}
	ran := false
	h := New(s, Options{Lease: lease}).Middleware(MiddlewareOptions{Scope: SingleTenant, FailOpen: true})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, keyed("late", "{}"))
	assert.False(t, ran, "FailOpen ran the handler on a late claim")
	assert.Equal(t, http.StatusServiceUnavailable, rr.Code)
}

// A waiter takes over from an owner that stopped renewing as soon as the
// owner's lease runs out, not at its next regular re-read: here that re-read
// is an hour away and the wait times out after 5s.
func TestWaiterTakesOverWhenLeaseRunsOut(t *testing.T) {
	check := func(t *testing.T, s Store) {
		ctx := context.Background()
		k, fp := Key{Scope: t.Name(), Name: "stopped"}, FingerprintOf("charge", nil)
		// An owner that claimed and then stopped: nothing renews its lease.
		c, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op-stopped", Lease: 300 * time.Millisecond, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, Owner, c.State)

		g := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 5 * time.Second})
		var attempt int
		var abandoned bool
		res, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			i, _ := FromContext(ctx)
			attempt, abandoned = i.Attempt, i.Abandoned
			return Response{Status: 201}, nil
		})
		require.NoError(t, err, "the waiter did not take over")
		assert.False(t, res.Replayed)
		assert.Equal(t, "op-stopped", res.OperationID)
		assert.Equal(t, 2, attempt)
		assert.True(t, abandoned)
	}
	t.Run("memory", func(t *testing.T) { check(t, NewMemoryStore(MemoryOptions{})) })
	redisBackends(t, func(t *testing.T, c *redis.Client) { check(t, newRedisStore(t, c)) })
}
