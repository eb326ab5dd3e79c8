package idempotencytest

import (
	"net/http"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// retention checks that a record is gone once its retention has passed,
// whether it was completed or still in flight: the next claim, with any
// fingerprint, makes a new record at attempt 1. The new record's token is
// greater than every earlier token of the key, so the owner of the expired
// record is fenced on the new one.
func retention(e *env) {
	fp := fingerprint("a")
	done := request(e.key("completed"), fp)
	doneOwner := e.own(done, 1, done.OperationID, "first claim of the record to complete")
	kept := idempotency.Response{Status: http.StatusCreated, Body: []byte("kept for a while")}
	require.NoError(e.t, e.store.Complete(e.ctx, done.Key, doneOwner.Token, kept, e.lease), "Complete with a short retention")
	e.requireReplay(request(done.Key, fp), done.OperationID, kept, "claim within the retention")
	flight := request(e.key("in-flight"), fp)
	flight.Lease, flight.Retention = e.lease, e.lease
	flightOwner := e.own(flight, 1, flight.OperationID, "first claim of the record left in flight, with a short retention")
	e.wait(e.past)

	again := request(done.Key, fingerprint("b"))
	c := e.own(again, 1, again.OperationID, "claim with another fingerprint after the completed record's retention")
	require.Greater(e.t, c.Token, doneOwner.Token, "the recreated record's token must be greater than the expired record's")
	e.requireFenced(done.Key, doneOwner.Token, "the expired completed record's owner")
	e.requireInFlight(request(done.Key, fingerprint("b")), longLease, "claim after the expired record's owner was fenced")

	again = request(flight.Key, fp)
	c = e.own(again, 1, again.OperationID, "claim after the in-flight record's retention")
	require.Greater(e.t, c.Token, flightOwner.Token, "the recreated record's token must be greater than the expired record's")
	e.requireFenced(flight.Key, flightOwner.Token, "the expired in-flight record's owner")
	e.requireInFlight(request(flight.Key, fp), longLease, "claim after the expired record's owner was fenced")
	want := idempotency.Response{Status: http.StatusOK, Body: []byte("the new owner's")}
	e.complete(flight.Key, c.Token, want, "the recreated record's owner")
	e.requireReplay(request(flight.Key, fp), again.OperationID, want, "claim after the recreated record completed")
}

// takeoverExtendsRetention checks that a takeover restarts the record's
// retention from the takeover, with the taking claim's retention: a record
// taken over shortly before its retention ran out is kept while the new
// owner runs, and the new owner's response is replayed.
func takeoverExtendsRetention(e *env) {
	fp := fingerprint("a")
	first := request(e.key("late-takeover"), fp)
	first.Lease, first.Retention = e.lease, e.lease+e.past
	e.own(first, 1, first.OperationID, "first claim, with a retention just past its lease")
	e.wait(e.past)
	taker := request(first.Key, fp)
	c := e.own(taker, 2, first.OperationID, "takeover after the lease ran out, before the retention did")
	e.wait(e.past) // the first claim's retention has now run out
	e.requireInFlight(request(first.Key, fp), longLease, "claim after the first claim's retention, during the takeover")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("settled late")}
	e.complete(first.Key, c.Token, want, "the late owner")
	e.requireReplay(request(first.Key, fp), first.OperationID, want, "claim after the late owner completed")
}

// renewalOutlivesRetention checks that a record is kept while its owner
// renews it: a renewal keeps the record at least until the renewed lease
// ends, even past the record's retention. Otherwise an operation that runs
// longer than the retention loses its record, a retry makes a new one (a
// second owner beside the first, under a new operation ID) and the first
// owner's outcome is refused.
func renewalOutlivesRetention(e *env) {
	fp := fingerprint("a")
	req := request(e.key("long-run"), fp)
	req.Lease, req.Retention = e.lease, e.lease
	c := e.own(req, 1, req.OperationID, "first claim, with a retention as long as its lease")
	e.wait(e.lease / 2)
	require.NoError(e.t, e.store.Heartbeat(e.ctx, req.Key, c.Token, 2*e.lease), "renewal halfway through the lease")
	e.wait(e.lease) // past the retention, well within the renewed lease
	e.requireInFlight(request(req.Key, fp), 2*e.lease, "claim past the retention, while the renewed lease runs")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("ran past its retention")}
	e.complete(req.Key, c.Token, want, "the owner that renewed past the retention")
	e.requireReplay(request(req.Key, fp), req.OperationID, want, "claim after the long-running owner completed")
}

// renewedRecordIsAbandonedAfterItsLease checks that a record whose owner
// renewed it past its retention and then stopped (a crash) is handled like
// any record whose owner died: listed by ListAbandoned once the lease ran out,
// and taken over with Abandoned set and the same operation ID, so that the
// operation's downstream keys stay the same. A renewal moves the record's
// expiry as far as it moves the lease.
func renewedRecordIsAbandonedAfterItsLease(e *env) {
	fp := fingerprint("a")
	req := request(e.key("renewed-then-dead"), fp)
	// A retention of three leases keeps the record two leases past its
	// lease's end, so that a slow listing still finds it unexpired.
	req.Lease, req.Retention = e.lease, 3*e.lease
	c := e.own(req, 1, req.OperationID, "first claim, with a retention of three leases")
	for range 4 {
		e.wait(e.lease / 2)
		require.NoError(e.t, e.store.Heartbeat(e.ctx, req.Key, c.Token, e.lease), "renewal every half lease")
	}
	e.wait(e.past) // the last lease ran out, and so did the claim's retention
	require.Contains(e.t, e.listed(req.Key), req.Key, "ListAbandoned lists the record whose owner stopped renewing")
	taker := e.own(request(req.Key, fp), 2, req.OperationID, "takeover of the record renewed past its retention")
	e.requireAbandoned(taker, true, "takeover of the record renewed past its retention")
}
