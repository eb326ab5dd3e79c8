package idempotencytest

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// abandonedTakeover checks Claim.Abandoned. A claim that takes a record over
// reports Abandoned when the previous attempt's lease ran out with the
// record unsettled, and not when the previous owner released the record. A
// claim that makes a record never reports it, even where a forgotten or
// expired record was. When the late owner releases while claims race to
// take the record over, the winner reports Abandoned exactly when its claim
// came before the release, which is when the release is fenced.
func abandonedTakeover(e *env) {
	fp := fingerprint("a")
	expired, _ := e.ownShortLease("expired", fp)
	released, releasedOwner := e.ownShortLease("released", fp)
	e.release(released.Key, releasedOwner.Token, "the owner of the record to release")
	forgotten, forgottenOwner := e.ownShortLease("forgotten", fp)
	e.forget(forgotten.Key, forgottenOwner.Token, "the owner of the record to forget")
	gone := request(e.key("gone"), fp)
	gone.Lease, gone.Retention = e.lease, e.lease
	e.own(gone, 1, gone.OperationID, "first claim, with a short lease and retention")
	type raced struct {
		req   idempotency.ClaimRequest
		owner idempotency.Claim
	}
	races := make([]raced, 4)
	for i := range races {
		races[i].req, races[i].owner = e.ownShortLease("release-race", fp)
	}
	e.wait(e.past)

	c := e.own(request(expired.Key, fp), 2, expired.OperationID, "claim after the lease ran out")
	e.requireAbandoned(c, true, "claim after the lease ran out")
	e.release(expired.Key, c.Token, "the owner that took the abandoned record over")
	c = e.own(request(expired.Key, fp), 3, expired.OperationID, "claim after the takeover's release")
	e.requireAbandoned(c, false, "claim after the takeover's release")

	c = e.own(request(released.Key, fp), 2, released.OperationID, "claim after release, its lease run out since")
	e.requireAbandoned(c, false, "claim after release, its lease run out since")

	again := request(forgotten.Key, fp)
	e.own(again, 1, again.OperationID, "claim after release with forget")
	again = request(gone.Key, fp)
	e.own(again, 1, again.OperationID, "claim after the in-flight record's retention ran out")

	for i, r := range races {
		what := fmt.Sprintf("race %d: concurrent claims while the late owner releases", i)
		reqs := racers(claimers/2, r.req.Key, fp)
		var err error
		cs := e.claimAll(reqs, func() { err = e.store.Release(e.ctx, r.req.Key, r.owner.Token) })
		if err != nil {
			require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: the late owner's Release", what)
		}
		w := e.requireOneOwner(reqs, cs, what)
		e.requireOwner(cs[w], 2, r.req.OperationID, what+": the winner")
		// A fenced Release means a claim took the record over first, while
		// it was abandoned; a Release that succeeded came first, and the
		// winner took over a released record.
		e.requireAbandoned(cs[w], err != nil, fmt.Sprintf("%s: the winner, the late owner's Release returning %v", what, err))
	}
}

// giveUpLease checks that Abandon gives the record up without settling it:
// the record stays in flight and is listed by ListAbandoned, and the next claim
// takes it over at once, without waiting for the lease, as an abandoned
// record under the same operation ID; exactly one of many concurrent claims
// does. The owner that gave the record up is fenced from then on, so it
// cannot abandon its successor's lease either.
func giveUpLease(e *env) {
	k, fp := e.key("give-up"), fingerprint("a")
	first := request(k, fp)
	old := e.own(first, 1, first.OperationID, "first claim")
	require.ErrorIs(e.t, e.store.Abandon(e.ctx, k, old.Token+1), idempotency.ErrFenced,
		"Abandon with a token not the owner's")
	e.requireInFlight(request(k, fp), longLease, "claim after the fenced Abandon")

	require.NoError(e.t, e.store.Abandon(e.ctx, k, old.Token), "the owner's Abandon")
	require.Equal(e.t, map[idempotency.Key]idempotency.Fingerprint{k: fp}, e.listed(k),
		"Abandoned after the owner gave its lease up")
	reqs := racers(claimers, k, fp)
	cs := e.claimAll(reqs)
	c := cs[e.requireOneOwner(reqs, cs, "concurrent claims after the owner gave its lease up")]
	e.requireOwner(c, 2, first.OperationID, "the takeover")
	e.requireAbandoned(c, true, "the takeover")
	require.Greater(e.t, c.Token, old.Token, "the takeover's token must be greater than the first owner's")
	require.ErrorIs(e.t, e.store.Abandon(e.ctx, k, old.Token), idempotency.ErrFenced,
		"the first owner's Abandon, after the takeover")
	e.requireFenced(k, old.Token, "the owner that gave its lease up")
	e.requireInFlight(request(k, fp), longLease, "claim after the first owner was fenced")
	require.Empty(e.t, e.listed(k), "Abandoned after the takeover")

	require.NoError(e.t, e.store.Abandon(e.ctx, k, c.Token), "the second owner's Abandon")
	c3 := e.own(request(k, fp), 3, first.OperationID, "claim after the second owner gave its lease up")
	e.requireAbandoned(c3, true, "claim after the second owner gave its lease up")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("the third owner's")}
	e.complete(k, c3.Token, want, "the third owner")
	e.requireReplay(request(k, fp), first.OperationID, want, "claim after the third owner completed")
}

// abandonedListing checks that Store.ListAbandoned lists every record in flight
// whose lease ran out, once, with its fingerprint, and no other record: not
// one whose lease is live or was renewed, nor one completed, released or
// past its retention, nor one since taken over or settled by its late
// owner. It returns at most limit records.
func abandonedListing(e *env) {
	type record struct {
		req   idempotency.ClaimRequest
		owner idempotency.Claim
	}
	var keys []idempotency.Key
	newRecord := func(label string, lease, retention time.Duration) record {
		req := request(e.key(label), fingerprint(label))
		req.Lease, req.Retention = lease, retention
		keys = append(keys, req.Key)
		return record{req, e.own(req, 1, req.OperationID, "first claim of the record "+label)}
	}
	var abandoned []record
	for i := range 4 {
		abandoned = append(abandoned, newRecord(fmt.Sprint("abandoned-", i), e.lease, longRetention))
	}
	newRecord("gone", e.lease, e.lease)
	newRecord("live", longLease, longRetention)
	renewed := newRecord("renewed", e.lease, longRetention)
	require.NoError(e.t, e.store.Heartbeat(e.ctx, renewed.req.Key, renewed.owner.Token, longLease), "the renewed record's Heartbeat")
	done := newRecord("completed", e.lease, longRetention)
	resp := idempotency.Response{Status: http.StatusCreated, Body: []byte("done")}
	e.complete(done.req.Key, done.owner.Token, resp, "the completed record's owner")
	released := newRecord("released", e.lease, longRetention)
	e.release(released.req.Key, released.owner.Token, "the released record's owner")
	kept := slices.Clone(keys)
	// Made last, with a retention one lease longer than the wait below: the
	// record is still kept after that wait and gone after the second one.
	expiring := newRecord("expiring", e.lease, e.lease+e.past)
	e.wait(e.past)

	want := map[idempotency.Key]idempotency.Fingerprint{expiring.req.Key: expiring.req.Fingerprint}
	for _, r := range abandoned {
		want[r.req.Key] = r.req.Fingerprint
	}
	got := e.listed(keys...)
	require.Equal(e.t, want, got, "records listed once the short leases ran out")
	const limit = 2
	list, err := e.store.ListAbandoned(e.ctx, limit)
	require.NoError(e.t, err, "ListAbandoned(%d)", limit)
	// The store may hold other cases' abandoned records, which can fill the
	// page, so only the page's bounds and this case's entries are checked.
	require.NotEmpty(e.t, list, "ListAbandoned(%d), with %d records of this case abandoned", limit, len(want))
	require.LessOrEqual(e.t, len(list), limit, "ListAbandoned(%d)", limit)
	for _, a := range list {
		if slices.Contains(keys, a.Key) {
			require.Contains(e.t, want, a.Key, "ListAbandoned(%d) listed a record not abandoned", limit)
			require.Equal(e.t, want[a.Key], a.Fingerprint, "ListAbandoned(%d) listed %q", limit, a.Key)
		}
	}

	// A sweeper claims a listed record with the fingerprint the listing gave.
	swept := abandoned[0].req.Key
	c := e.own(idempotency.ClaimRequest{Key: swept, Fingerprint: got[swept], OperationID: "op-sweeper",
		Lease: longLease, Retention: longRetention}, 2, abandoned[0].req.OperationID, "a sweeper's claim of a listed record")
	e.requireAbandoned(c, true, "a sweeper's claim of a listed record")
	// The owners of abandoned records that no claim took over still hold the
	// current token, so they can still complete or release.
	e.complete(abandoned[1].req.Key, abandoned[1].owner.Token, resp, "a late owner")
	e.release(abandoned[2].req.Key, abandoned[2].owner.Token, "a late owner")
	still := map[idempotency.Key]idempotency.Fingerprint{abandoned[3].req.Key: abandoned[3].req.Fingerprint}
	require.Equal(e.t, still, e.listed(kept...), "records listed after a takeover and two late settlements")

	e.wait(e.past)
	require.Equal(e.t, still, e.listed(keys...), "records listed after the expiring record's retention ran out")
}
