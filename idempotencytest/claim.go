package idempotencytest

import (
	"crypto/rand"
	"fmt"
	"net/http"
	"strings"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// claimCreatesRecord checks that a claim of a key that has no record
// creates the record and makes the caller its owner, at attempt 1, under the
// operation ID the claim brought. Another key gets a record of its own.
func claimCreatesRecord(e *env) {
	req := request(e.key("fresh"), fingerprint("a"))
	e.own(req, 1, req.OperationID, "first claim")

	// A second fresh key gets its own record and its own operation ID.
	other := request(e.key("fresh"), fingerprint("a"))
	e.own(other, 1, other.OperationID, "first claim of another key")
}

// inFlightWhileLeaseLive checks that while the owner's lease is live, every
// other claim of the record, watching or not, is answered InFlight and
// changes nothing: the owner can still renew and complete the record, and
// its response is replayed.
func inFlightWhileLeaseLive(e *env) {
	k, fp := e.key("inflight"), fingerprint("a")
	first := request(k, fp)
	owner := e.own(first, 1, first.OperationID, "first claim")
	e.requireInFlight(request(k, fp), longLease, "second claim")
	watching := request(k, fp)
	watching.Watch = true
	e.requireInFlight(watching, longLease, "watching claim")

	require.NoError(e.t, e.store.Heartbeat(e.ctx, k, owner.Token, longLease), "the owner's Heartbeat after the in-flight claims")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("done")}
	e.complete(k, owner.Token, want, "the owner, after the in-flight claims")
	e.requireReplay(request(k, fp), first.OperationID, want, "claim after completion")
}

// fingerprintMismatch checks that a claim whose fingerprint differs from the
// record's is answered Mismatch whether the record is in flight, completed
// or released, and leaves the record as it was: a later claim with the
// record's fingerprint still gets the replay, or takes the released record
// over under its operation ID.
func fingerprintMismatch(e *env) {
	fp, other := fingerprint("a"), fingerprint("b")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("done")}
	e.run("InFlight", func(e *env) {
		k := e.key("mismatch")
		first := request(k, fp)
		owner := e.own(first, 1, first.OperationID, "first claim")
		e.requireState(idempotency.Mismatch, e.claim(request(k, other)), "claim with another fingerprint while in flight")
		watching := request(k, other)
		watching.Watch = true
		e.requireState(idempotency.Mismatch, e.claim(watching), "watching claim with another fingerprint while in flight")
		e.complete(k, owner.Token, want, "the owner, after the mismatching claims")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after completion")
	})
	e.run("Completed", func(e *env) {
		k := e.key("mismatch")
		first := request(k, fp)
		owner := e.own(first, 1, first.OperationID, "first claim")
		e.complete(k, owner.Token, want, "the owner")
		e.requireState(idempotency.Mismatch, e.claim(request(k, other)), "claim with another fingerprint after completion")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after the mismatching claim")
	})
	e.run("Released", func(e *env) {
		k := e.key("mismatch")
		first := request(k, fp)
		owner := e.own(first, 1, first.OperationID, "first claim")
		e.release(k, owner.Token, "the owner")
		e.requireState(idempotency.Mismatch, e.claim(request(k, other)), "claim with another fingerprint after release")
		e.own(request(k, fp), 2, first.OperationID, "claim with the record's fingerprint after the mismatching claim")
	})
}

// concurrentClaims checks that of many concurrent claims of a key that has
// no record, exactly one becomes the owner, at attempt 1 under its own
// operation ID, and every other one is answered InFlight, or Mismatch when
// its fingerprint differs from the owner's. It races claims for one key, for
// many keys at once, and with two different requests for one key.
func concurrentClaims(e *env) {
	fp := fingerprint("a")
	e.run("OneKey", func(e *env) {
		reqs := racers(claimers, e.key("race"), fp)
		cs := e.claimAll(reqs)
		w := e.requireOneOwner(reqs, cs, "concurrent first claims")
		e.requireOwner(cs[w], 1, reqs[w].OperationID, "the winning claim")
	})
	e.run("ManyKeys", func(e *env) {
		const keys, perKey = 8, claimers / 2
		var reqs []idempotency.ClaimRequest
		for range keys {
			reqs = append(reqs, racers(perKey, e.key("race"), fp)...)
		}
		cs := e.claimAll(reqs)
		for i := 0; i < len(reqs); i += perKey {
			what := fmt.Sprintf("concurrent first claims of key %d", i/perKey)
			w := i + e.requireOneOwner(reqs[i:i+perKey], cs[i:i+perKey], what)
			e.requireOwner(cs[w], 1, reqs[w].OperationID, what+": the winning claim")
		}
	})
	e.run("MixedFingerprints", func(e *env) {
		reqs := racers(claimers, e.key("race"), fp)
		for i := 1; i < len(reqs); i += 2 {
			reqs[i].Fingerprint = fingerprint("b")
		}
		cs := e.claimAll(reqs)
		w := e.requireOneOwner(reqs, cs, "concurrent first claims of two requests")
		e.requireOwner(cs[w], 1, reqs[w].OperationID, "the winning claim")
	})
}

// keysAndScopes checks that every distinct Key has a record of its own:
// equal names in different scopes do not share a record, and no characters
// in scope or name (separators, Redis hash-tag braces, SQL quotes and
// patterns, non-ASCII text, a name of MaxKeyLength) make two keys reach the
// same record.
func keysAndScopes(e *env) {
	u := rand.Text() // keeps the keys apart from earlier runs on a shared store
	keys := []idempotency.Key{
		{Scope: u, Name: "n"},
		{Scope: u + "-other", Name: "n"},
		{Scope: "", Name: u + "-n"},
		// Pairs that would share a record if scope and name were joined
		// with ':'.
		{Scope: u + "a:b", Name: "c"},
		{Scope: u + "a", Name: "b:c"},
		{Scope: u + ":", Name: "n"},
		{Scope: u, Name: ":n"},
		// Redis hash-tag braces, in scope, name, or split between them.
		{Scope: u + "{tag}", Name: "n"},
		{Scope: u, Name: "{n}"},
		{Scope: u, Name: "}{:"},
		{Scope: u + "{", Name: "}"},
		{Scope: u + " acct 42 ", Name: "n"},
		{Scope: u + "ü-日本-🙂", Name: "n"},
		// SQL quoting, LIKE and glob patterns.
		{Scope: u + `'";\%_*?[]`, Name: `'";\%_*?[]`},
		{Scope: u, Name: strings.Repeat("k", idempotency.MaxKeyLength)},
	}
	reqs := make([]idempotency.ClaimRequest, len(keys))
	owners := make([]idempotency.Claim, len(keys))
	responses := make([]idempotency.Response, len(keys))
	for i, k := range keys {
		require.NoError(e.t, k.Validate(), "key %d %q", i, k)
		// Each key has a fingerprint of its own, so a claim that reaches
		// another key's record is answered Mismatch.
		reqs[i] = request(k, fingerprint(fmt.Sprint(i)))
		owners[i] = e.own(reqs[i], 1, reqs[i].OperationID, fmt.Sprintf("first claim of key %d %q", i, k))
		responses[i] = idempotency.Response{Status: http.StatusCreated,
			Header: http.Header{"X-Key": {k.Scope, k.Name}}, Body: []byte(fmt.Sprintf("key %d", i))}
	}
	for i, k := range keys {
		e.requireInFlight(request(k, reqs[i].Fingerprint), longLease, fmt.Sprintf("second claim of key %d %q", i, k))
	}
	for i, k := range keys {
		e.complete(k, owners[i].Token, responses[i], fmt.Sprintf("the owner of key %d %q", i, k))
	}
	for i, k := range keys {
		e.requireReplay(request(k, reqs[i].Fingerprint), reqs[i].OperationID, responses[i], fmt.Sprintf("replay of key %d %q", i, k))
	}
}
