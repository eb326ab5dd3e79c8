package idempotencytest

import (
	"errors"
	"net/http"
	"slices"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inspection checks a store that implements idempotency.Inspector. Inspect
// shows a record in every state as the store holds it, with a stored
// response's status, header names and body size but never its body;
// ListInFlight lists every record in flight, abandoned ones included, once,
// the earliest lease end first, page by page, and nothing settled. A store
// that is no Inspector skips it.
func inspection(e *env) {
	in, ok := e.store.(idempotency.Inspector)
	if !ok {
		e.t.Skip("the store is no idempotency.Inspector")
	}
	fp := fingerprint("inspected")
	_, err := in.Inspect(e.ctx, e.key("none"))
	require.ErrorIs(e.t, err, idempotency.ErrNoRecord, "Inspect of a key never claimed")

	abandoned, abandonedOwner := e.ownShortLease("abandoned", fp)
	live := request(e.key("live"), fp)
	liveOwner := e.own(live, 1, live.OperationID, "a claim that holds its lease")
	done := request(e.key("done"), fp)
	doneOwner := e.own(done, 1, done.OperationID, "a claim to complete")
	e.complete(done.Key, doneOwner.Token, idempotency.Response{Status: http.StatusCreated,
		Header: http.Header{"Set-Cookie": {"secret"}, "Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}, "the owner")
	released := request(e.key("released"), fp)
	releasedOwner := e.own(released, 1, released.OperationID, "a claim to release")
	e.release(released.Key, releasedOwner.Token, "the owner")
	e.wait(e.past)

	r := e.inspect(in, live.Key)
	assert.Equal(e.t, idempotency.RecordInFlight, r.State)
	assert.Equal(e.t, live.OperationID, r.OperationID)
	assert.Equal(e.t, fp, r.Fingerprint)
	assert.Equal(e.t, 1, r.Attempt)
	assert.Equal(e.t, liveOwner.Token, r.Token)
	assert.True(e.t, r.LeaseLeft > 0 && r.LeaseLeft <= longLease, "lease left %v", r.LeaseLeft)
	assert.True(e.t, r.ExpiresIn > 0 && r.ExpiresIn <= longRetention, "expires in %v", r.ExpiresIn)

	r = e.inspect(in, abandoned.Key)
	assert.Equal(e.t, idempotency.RecordAbandoned, r.State)
	assert.Equal(e.t, abandonedOwner.Token, r.Token)
	assert.LessOrEqual(e.t, r.LeaseLeft, e.lease-e.past+e.lease/10, "lease left of an abandoned record")

	r = e.inspect(in, done.Key)
	assert.Equal(e.t, idempotency.RecordCompleted, r.State)
	assert.Equal(e.t, done.OperationID, r.OperationID)
	assert.Equal(e.t, http.StatusCreated, r.Status)
	assert.Equal(e.t, []string{"Content-Type", "Set-Cookie"}, r.HeaderNames)
	assert.Equal(e.t, len(`{"id":"ch_1"}`), r.BodySize)

	r = e.inspect(in, released.Key)
	assert.Equal(e.t, idempotency.RecordReleased, r.State)
	assert.Equal(e.t, 1, r.Attempt)

	// Every record in flight of this case, page by page, in order.
	var mine []idempotency.Key
	after, last := "", idempotency.Record{}
	for pages := 0; ; pages++ {
		require.Less(e.t, pages, 100000, "ListInFlight never ended")
		page, next, err := in.ListInFlight(e.ctx, after, 3)
		require.NoError(e.t, err, "ListInFlight")
		require.LessOrEqual(e.t, len(page), 3)
		for _, r := range page {
			require.True(e.t, r.State == idempotency.RecordInFlight || r.State == idempotency.RecordAbandoned,
				"ListInFlight listed a record %v", r.State)
			if last.Key != (idempotency.Key{}) && last.State == idempotency.RecordInFlight {
				assert.NotEqual(e.t, idempotency.RecordAbandoned, r.State, "an abandoned record after one in flight")
			}
			if r.Key.Scope == e.scope {
				mine = append(mine, r.Key)
			}
			last = r
		}
		if next == "" {
			break
		}
		after = next
	}
	assert.Equal(e.t, []idempotency.Key{abandoned.Key, live.Key}, mine, "this case's records in flight, the earliest lease end first")
	_, _, err = in.ListInFlight(e.ctx, "not a cursor", 3)
	assert.Error(e.t, err, "ListInFlight after a malformed cursor")
}

// operatorActions checks Guard.Act on a store that implements
// idempotency.Inspector: an operator settles an abandoned record, whose
// retries then replay the outcome the operator gave; releases another,
// which the next retry runs; forgets a live owner's record only when
// forced, fencing that owner off; and is refused, changing nothing, when
// the record changed since it was inspected.
func operatorActions(e *env) {
	in, ok := e.store.(idempotency.Inspector)
	if !ok {
		e.t.Skip("the store is no idempotency.Inspector")
	}
	g := idempotency.New(e.store, idempotency.Options{Lease: longLease, Retention: longRetention})
	fp := fingerprint("acted on")
	settle, _ := e.ownShortLease("settle", fp)
	release, _ := e.ownShortLease("release", fp)
	stale, _ := e.ownShortLease("stale", fp)
	relapsed, _ := e.ownShortLease("relapsed", fp)
	live := request(e.key("live"), fp)
	liveOwner := e.own(live, 1, live.OperationID, "a claim that holds its lease")
	e.wait(e.past)

	decided := idempotency.Response{Status: http.StatusPaymentRequired, Body: []byte(`{"error":"declined"}`)}
	require.NoError(e.t, g.Act(e.ctx, e.inspect(in, settle.Key), idempotency.OperatorAction{Disposition: idempotency.Keep, Response: decided}))
	c := e.claim(request(settle.Key, fp))
	e.requireState(idempotency.Completed, c, "a retry of the record the operator settled")
	assert.Equal(e.t, decided.Status, c.Response.Status)
	assert.Equal(e.t, decided.Body, c.Response.Body)
	assert.Equal(e.t, settle.OperationID, c.OperationID)

	require.NoError(e.t, g.Act(e.ctx, e.inspect(in, release.Key), idempotency.OperatorAction{Disposition: idempotency.Release}))
	e.own(request(release.Key, fp), 3, release.OperationID, "a retry of the record the operator released")

	seen := e.inspect(in, live.Key)
	err := g.Act(e.ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Forget})
	require.ErrorIs(e.t, err, idempotency.ErrLiveOwner, "an action on a live owner's record, unforced")
	require.NoError(e.t, g.Act(e.ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Forget, Force: true}))
	require.ErrorIs(e.t, e.store.Complete(e.ctx, live.Key, liveOwner.Token, decided, longRetention), idempotency.ErrFenced,
		"the owner whose record the operator forgot")
	again := request(live.Key, fingerprint("another request"))
	e.own(again, 1, again.OperationID, "a claim of the forgotten key")

	seen = e.inspect(in, stale.Key)
	retry := e.own(request(stale.Key, fp), 2, stale.OperationID, "a retry that takes the record over after it was inspected")
	err = g.Act(e.ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Release})
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "an action on a record that changed since it was inspected")
	e.complete(stale.Key, retry.Token, decided, "the retry, after the operator's refused action")

	// Released since it was inspected: refused, and still released.
	seen = e.inspect(in, relapsed.Key)
	retry = e.own(request(relapsed.Key, fp), 2, relapsed.OperationID, "a retry that takes the record over after it was inspected")
	e.release(relapsed.Key, retry.Token, "that retry")
	err = g.Act(e.ctx, seen, idempotency.OperatorAction{Disposition: idempotency.Forget})
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "an action on a record released since it was inspected")
	assert.Equal(e.t, idempotency.RecordReleased, e.inspect(in, relapsed.Key).State, "the record after the refused action")

	err = g.Act(e.ctx, idempotency.Record{Key: settle.Key, State: idempotency.RecordCompleted}, idempotency.OperatorAction{Disposition: idempotency.Release})
	assert.Error(e.t, err, "an action on a completed record")
	assert.False(e.t, errors.Is(err, idempotency.ErrFenced))
}

func (e *env) inspect(in idempotency.Inspector, k idempotency.Key) idempotency.Record {
	e.t.Helper()
	r, err := in.Inspect(e.ctx, k)
	require.NoError(e.t, err, "Inspect(%q)", k)
	require.Equal(e.t, k, r.Key)
	require.False(e.t, slices.Contains(r.HeaderNames, ""), "an empty header name")
	return r
}
