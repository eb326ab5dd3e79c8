package idempotencytest

import (
	"fmt"
	"net/http"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// wakeUp checks that the subscribers of a watched record are woken when the
// record is settled by Complete, Release or Forget, and that a claim after
// the wake-up sees the outcome: the replay, or ownership of the record. A
// wake-up is kept for a subscriber that is not reading C when it comes. A
// closed subscription is not woken, and Close may be called twice.
func wakeUp(e *env) {
	fp := fingerprint("a")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("settled")}
	// watched creates an owned record, subscribes n times, then makes a
	// watching claim that finds it in flight.
	watched := func(e *env, n int) (first idempotency.ClaimRequest, owner idempotency.Claim, watch idempotency.ClaimRequest, subs []idempotency.Subscription) {
		first = request(e.key("wake"), fp)
		owner = e.own(first, 1, first.OperationID, "first claim")
		for range n {
			subs = append(subs, e.subscribe(first.Key))
		}
		watch = request(first.Key, fp)
		watch.Watch = true
		e.requireInFlight(watch, longLease, "watching claim")
		return first, owner, watch, subs
	}
	// settle runs f in another goroutine, as another process's owner would,
	// and returns its error once f is done. The subscribers read C only
	// after that, so the store must keep a wake-up for a subscriber that is
	// not reading C when it comes.
	settle := func(f func() error) error {
		errc := make(chan error, 1)
		go func() { errc <- f() }()
		return <-errc
	}
	e.run("Complete", func(e *env) {
		first, owner, watch, subs := watched(e, 2)
		require.NoError(e.t, settle(func() error {
			return e.store.Complete(e.ctx, first.Key, owner.Token, want, longRetention)
		}), "the owner's Complete")
		for i, sub := range subs {
			what := fmt.Sprintf("subscription %d, after Complete", i)
			c := e.awaitSettled(sub, watch, what)
			e.requireState(idempotency.Completed, c, what)
			require.Equal(e.t, first.OperationID, c.OperationID, "%s: operation ID", what)
			requireResponse(e.t, want, c.Response, what)
		}
	})
	e.run("Release", func(e *env) {
		first, owner, watch, subs := watched(e, 1)
		require.NoError(e.t, settle(func() error { return e.store.Release(e.ctx, first.Key, owner.Token) }),
			"the owner's Release")
		e.requireOwner(e.awaitSettled(subs[0], watch, "after Release"), 2, first.OperationID, "the woken waiter")
	})
	e.run("Forget", func(e *env) {
		first, owner, watch, subs := watched(e, 1)
		require.NoError(e.t, settle(func() error { return e.store.Forget(e.ctx, first.Key, owner.Token) }),
			"the owner's Release with forget")
		e.requireOwner(e.awaitSettled(subs[0], watch, "after Release with forget"), 1, watch.OperationID, "the woken waiter")
	})
	e.run("CloseStopsDelivery", func(e *env) {
		first, owner, watch, subs := watched(e, 2)
		closed, open := subs[0], subs[1]
		closed.Close()
		closed.Close() // Close may be called again, as a deferred Close often is
		e.complete(first.Key, owner.Token, want, "the owner")
		e.requireState(idempotency.Completed, e.awaitSettled(open, watch, "the open subscription"), "the open subscription")
		// The open subscription has been woken, so a wake-up sent to the
		// closed one would have arrived by now: it must not receive one.
		select {
		case _, ok := <-closed.C():
			require.False(e.t, ok, "a closed subscription was woken")
		case <-time.After(100 * time.Millisecond):
		}
	})
}
