package idempotencytest

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// recoveryPoints checks a store that implements
// idempotency.RecoveryPointStore. An owner's points are kept in the order
// saved, once per step however often a save is resent; a stale owner can
// neither save nor read them; the next attempt sees them after a release,
// after an abandoned lease, and after the record's retention was extended
// by a takeover; a record forgotten, or expired and made anew, has none. A
// store that is no RecoveryPointStore, or answers ErrNoRecoveryPoints (a
// migrating store over stores that keep none), skips it.
func recoveryPoints(e *env) {
	ps, ok := e.store.(idempotency.RecoveryPointStore)
	if !ok {
		e.t.Skip("the store is no idempotency.RecoveryPointStore")
	}
	fp := fingerprint("steps")
	point := func(step string) idempotency.RecoveryPoint {
		return idempotency.RecoveryPoint{Step: step, Result: []byte(fmt.Sprintf(`{"step":%q}`, step))}
	}
	save := func(e *env, k idempotency.Key, token uint64, steps ...string) {
		e.t.Helper()
		for _, s := range steps {
			require.NoError(e.t, ps.SaveRecoveryPoint(e.ctx, k, token, point(s)), "SaveRecoveryPoint(%q)", s)
		}
	}
	requirePoints := func(e *env, k idempotency.Key, token uint64, what string, steps ...string) {
		e.t.Helper()
		got, err := ps.RecoveryPoints(e.ctx, k, token)
		require.NoError(e.t, err, "%s: RecoveryPoints", what)
		want := []idempotency.RecoveryPoint{}
		for _, s := range steps {
			want = append(want, point(s))
		}
		require.Equal(e.t, want, append([]idempotency.RecoveryPoint{}, got...), "%s: recovery points", what)
	}

	e.run("KeptInOrderThroughRelease", func(e *env) {
		req := request(e.key("released"), fp)
		first := e.own(req, 1, req.OperationID, "first claim")
		if _, err := ps.RecoveryPoints(e.ctx, req.Key, first.Token); errors.Is(err, idempotency.ErrNoRecoveryPoints) {
			e.t.Skip("the store keeps no recovery points:", err)
		}
		requirePoints(e, req.Key, first.Token, "a new record", []string{}...)
		save(e, req.Key, first.Token, "order", "charge", "order", "receipt", "charge")
		requirePoints(e, req.Key, first.Token, "the owner, a resent save included", "order", "charge", "receipt")
		e.release(req.Key, first.Token, "the first owner")
		second := e.own(req, 2, req.OperationID, "the claim after the release")
		requirePoints(e, req.Key, second.Token, "the next attempt", "order", "charge", "receipt")
		save(e, req.Key, second.Token, "publish")
		requirePoints(e, req.Key, second.Token, "the next attempt's own", "order", "charge", "receipt", "publish")
		requireInspectedSteps(e, req.Key, "order", "charge", "receipt", "publish")
		e.complete(req.Key, second.Token, idempotency.Response{Status: http.StatusCreated}, "the second owner")
		requireInspectedSteps(e, req.Key)
	})

	e.run("StaleOwnerFenced", func(e *env) {
		req := request(e.key("fenced"), fp)
		first := e.own(req, 1, req.OperationID, "first claim")
		save(e, req.Key, first.Token, "order")
		e.release(req.Key, first.Token, "the first owner")
		second := e.own(req, 2, req.OperationID, "the claim after the release")
		err := ps.SaveRecoveryPoint(e.ctx, req.Key, first.Token, point("charge"))
		require.ErrorIs(e.t, err, idempotency.ErrFenced, "a save by the owner taken over")
		_, err = ps.RecoveryPoints(e.ctx, req.Key, first.Token)
		require.ErrorIs(e.t, err, idempotency.ErrFenced, "a read by the owner taken over")
		requirePoints(e, req.Key, second.Token, "the current owner, after a stale save", "order")
		e.complete(req.Key, second.Token, idempotency.Response{Status: http.StatusCreated}, "the current owner")
		err = ps.SaveRecoveryPoint(e.ctx, req.Key, second.Token, point("late"))
		require.ErrorIs(e.t, err, idempotency.ErrFenced, "a save after the completion")
	})

	e.run("KeptThroughAbandonedLease", func(e *env) {
		req, first := e.ownShortLease("abandoned", fp)
		save(e, req.Key, first.Token, "order", "charge")
		e.wait(e.past)
		second := e.own(request(req.Key, fp), 2, req.OperationID, "the takeover of an abandoned record")
		e.requireAbandoned(second, true, "the takeover")
		requirePoints(e, req.Key, second.Token, "the takeover", "order", "charge")
	})

	e.run("KeptWhileTakeoverExtendsRetention", func(e *env) {
		req := request(e.key("extended"), fp)
		req.Retention = 2 * e.lease
		first := e.own(req, 1, req.OperationID, "first claim, with a short retention")
		save(e, req.Key, first.Token, "order")
		e.release(req.Key, first.Token, "the first owner")
		req.Retention = longRetention
		second := e.own(req, 2, req.OperationID, "the takeover, with a long retention")
		e.release(req.Key, second.Token, "the second owner")
		e.wait(2 * e.past)
		third := e.own(req, 3, req.OperationID, "a claim after the first retention would have run out")
		requirePoints(e, req.Key, third.Token, "the third attempt", "order")
	})

	e.run("GoneWithTheRecord", func(e *env) {
		req := request(e.key("forgotten"), fp)
		first := e.own(req, 1, req.OperationID, "first claim")
		save(e, req.Key, first.Token, "order")
		e.forget(req.Key, first.Token, "the owner")
		again := request(req.Key, fp)
		made := e.own(again, 1, again.OperationID, "a claim after Forget")
		requirePoints(e, again.Key, made.Token, "a record made after Forget", []string{}...)
		e.release(again.Key, made.Token, "its owner")
		taken := e.own(again, 2, again.OperationID, "a takeover of it")
		requirePoints(e, again.Key, taken.Token, "a takeover of a record made after Forget", []string{}...)

		short := request(e.key("expired"), fp)
		short.Retention = e.lease
		old := e.own(short, 1, short.OperationID, "first claim, with a short retention")
		save(e, short.Key, old.Token, "order")
		e.release(short.Key, old.Token, "its owner")
		e.wait(e.past)
		anew := request(short.Key, fp)
		made = e.own(anew, 1, anew.OperationID, "a claim after the record expired")
		e.release(anew.Key, made.Token, "its owner")
		taken = e.own(anew, 2, anew.OperationID, "a takeover of the record made anew")
		requirePoints(e, anew.Key, taken.Token, "a record made after one expired", []string{}...)
	})
}

// requireInspectedSteps requires a store that is an Inspector to show the
// steps of k's record, by name, in Inspect and, for a record in flight, in
// ListInFlight.
func requireInspectedSteps(e *env, k idempotency.Key, steps ...string) {
	e.t.Helper()
	in, ok := e.store.(idempotency.Inspector)
	if !ok {
		return
	}
	r := e.inspect(in, k)
	require.Equal(e.t, steps, append([]string(nil), r.Steps...), "the steps Inspect shows of a record %v", r.State)
	if r.State != idempotency.RecordInFlight {
		return
	}
	for after := ""; ; {
		recs, next, err := in.ListInFlight(e.ctx, after, listAll)
		require.NoError(e.t, err, "ListInFlight")
		for _, l := range recs {
			if l.Key == k {
				require.Equal(e.t, steps, append([]string(nil), l.Steps...), "the steps ListInFlight shows")
				return
			}
		}
		require.NotEmpty(e.t, next, "ListInFlight did not list the record in flight")
		after = next
	}
}
