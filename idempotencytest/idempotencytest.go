// Package idempotencytest is the conformance suite that every
// idempotency.Store passes. It checks the record's state machine (see the
// Store interface): claims, takeovers, fencing, retention, wake-ups, the
// atomicity of concurrent claims, abandoned records and their listing, and
// the Guard running on top of the store, also once the store stops answering.
//
// A store's test calls Run:
//
//	func TestConformance(t *testing.T) {
//		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
//			return idempotencytest.Harness{Store: newStore(t)}
//		})
//	}
package idempotencytest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// Harness is what the suite needs from one store under test.
type Harness struct {
	// Store is the store under test.
	Store idempotency.Store
	// Advance moves every clock by which Store judges leases and retention
	// forward by d (a MemoryStore's MemoryOptions.Now; for miniredis both
	// SetTime, which TIME follows, and FastForward, which expires keys). The
	// suite calls it from the case's goroutine, between store calls, never
	// while cases run in parallel. Nil: the suite waits in real time, with
	// leases of 300ms, about 3.5s in all.
	Advance func(d time.Duration)
}

// Run runs every conformance case as a subtest of t. It calls newHarness
// once per case, with the case's t; it may return a fresh store or the same
// one every time: every case uses keys of its own.
//
// Besides the Store interface's contract, the suite holds a store to what
// callers of it rely on: Complete keeps a copy of the response, so the
// caller may reuse its buffers; a wake-up is kept for a subscriber that is
// not reading C when it comes; Subscription.Close may be called more than
// once. Tokens are compared only within one key.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	cases := []struct {
		name string
		run  func(*env)
	}{
		{"ClaimCreatesRecord", claimCreatesRecord},
		{"InFlightWhileLeaseLive", inFlightWhileLeaseLive},
		{"FingerprintMismatch", fingerprintMismatch},
		{"CompleteThenReplay", completeThenReplay},
		{"TakeoverAfterLeaseExpiry", takeoverAfterLeaseExpiry},
		{"ReleaseThenClaim", releaseThenClaim},
		{"Fencing", fencing},
		{"HeartbeatExtendsLease", heartbeatExtendsLease},
		{"Retention", retention},
		{"TakeoverExtendsRetention", takeoverExtendsRetention},
		{"WakeUp", wakeUp},
		{"ConcurrentClaims", concurrentClaims},
		{"Guard", guard},
		{"KeysAndScopes", keysAndScopes},
		{"AbandonedTakeover", abandonedTakeover},
		{"GiveUpLease", giveUpLease},
		{"AbandonedListing", abandonedListing},
		{"SilentStoreStopsOwner", silentStoreStopsOwner},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.run(newEnv(t, newHarness(t)))
		})
	}
}

const (
	longLease     = time.Minute // a lease that never runs out during a case
	longRetention = time.Hour   // a retention that never runs out during a case
	wakeTimeout   = 5 * time.Second
	claimers      = 50 // goroutines that race for one record
	// listAll is a limit for Abandoned above every record a shared store
	// holds for the suite, so that a case sees all of its own.
	listAll = 100000
)

// env is one case's view of the store under test.
type env struct {
	t       *testing.T
	ctx     context.Context
	store   idempotency.Store
	advance func(time.Duration)
	scope   string
	// lease is a lease (or retention) that a case lets run out; past is a
	// wait after which it has run out, judged by the store's clock.
	lease, past time.Duration
}

func newEnv(t *testing.T, h Harness) *env {
	require.NotNil(t, h.Store, "Harness.Store is nil")
	e := &env{t: t, ctx: t.Context(), store: h.Store, advance: h.Advance, scope: t.Name(),
		lease: 300 * time.Millisecond, past: 400 * time.Millisecond}
	if h.Advance != nil {
		e.lease, e.past = 10*time.Second, 11*time.Second
	}
	return e
}

// run runs a sub-case with its own env.
func (e *env) run(name string, f func(*env)) {
	e.t.Run(name, func(t *testing.T) {
		sub := *e
		sub.t, sub.ctx, sub.scope = t, t.Context(), t.Name()
		f(&sub)
	})
}

// wait lets d pass on the store's clock.
func (e *env) wait(d time.Duration) {
	if e.advance != nil {
		e.advance(d)
		return
	}
	time.Sleep(d)
}

// key returns a key no other case or run uses.
func (e *env) key(label string) idempotency.Key {
	return idempotency.Key{Scope: e.scope, Name: label + "-" + rand.Text()}
}

func fingerprint(request string) idempotency.Fingerprint {
	return idempotency.FingerprintOf("idempotencytest", []byte(request))
}

// request is a claim of k by a request fingerprinted fp, with an operation
// ID of its own, a lease that does not run out and a long retention.
func request(k idempotency.Key, fp idempotency.Fingerprint) idempotency.ClaimRequest {
	return idempotency.ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op-" + rand.Text(),
		Lease: longLease, Retention: longRetention}
}

func (e *env) claim(req idempotency.ClaimRequest) idempotency.Claim {
	e.t.Helper()
	c, err := e.store.Claim(e.ctx, req)
	require.NoError(e.t, err, "Claim(%q)", req.Key)
	return c
}

// own claims req and asserts that it made the caller the owner.
func (e *env) own(req idempotency.ClaimRequest, attempt int, opID, what string) idempotency.Claim {
	e.t.Helper()
	c := e.claim(req)
	e.requireOwner(c, attempt, opID, what)
	return c
}

func (e *env) requireOwner(c idempotency.Claim, attempt int, opID, what string) {
	e.t.Helper()
	e.requireState(idempotency.Owner, c, what)
	require.Equal(e.t, attempt, c.Attempt, "%s: attempt", what)
	require.Equal(e.t, opID, c.OperationID, "%s: operation ID", what)
	require.NotZero(e.t, c.Token, "%s: token", what)
	if attempt == 1 {
		require.False(e.t, c.Abandoned, "%s: Abandoned, for a claim that made the record", what)
	}
}

// requireAbandoned asserts whether an owner's claim took over a record whose
// previous attempt was abandoned.
func (e *env) requireAbandoned(c idempotency.Claim, abandoned bool, what string) {
	e.t.Helper()
	require.Equal(e.t, abandoned, c.Abandoned, "%s: Abandoned (claim: %s)", what, describe(c))
}

// listed returns the records of keys that Abandoned lists, with their
// fingerprints. The store may hold other cases' abandoned records, so it
// asks for every record and leaves the others' out.
func (e *env) listed(keys ...idempotency.Key) map[idempotency.Key]idempotency.Fingerprint {
	e.t.Helper()
	list, err := e.store.Abandoned(e.ctx, listAll)
	require.NoError(e.t, err, "Abandoned(%d)", listAll)
	got := make(map[idempotency.Key]idempotency.Fingerprint)
	for _, a := range list {
		if !slices.Contains(keys, a.Key) {
			continue
		}
		_, twice := got[a.Key]
		require.False(e.t, twice, "Abandoned(%d) listed %q twice", listAll, a.Key)
		got[a.Key] = a.Fingerprint
	}
	return got
}

func (e *env) requireState(want idempotency.ClaimState, c idempotency.Claim, what string) {
	e.t.Helper()
	require.Equal(e.t, stateName(want), stateName(c.State), "%s: claim state (claim: %s)", what, describe(c))
}

func describe(c idempotency.Claim) string {
	return fmt.Sprintf("%s, operation ID %q, attempt %d, token %d, lease left %v, response status %d",
		stateName(c.State), c.OperationID, c.Attempt, c.Token, c.LeaseLeft, c.Response.Status)
}

// requireInFlight claims req and asserts that a live lease of at most lease
// holds the record.
func (e *env) requireInFlight(req idempotency.ClaimRequest, lease time.Duration, what string) {
	e.t.Helper()
	c := e.claim(req)
	e.requireState(idempotency.InFlight, c, what)
	require.Greater(e.t, c.LeaseLeft, time.Duration(0), "%s: LeaseLeft", what)
	require.LessOrEqual(e.t, c.LeaseLeft, lease, "%s: LeaseLeft", what)
}

// requireReplay claims req and asserts that it replays want under opID.
func (e *env) requireReplay(req idempotency.ClaimRequest, opID string, want idempotency.Response, what string) {
	e.t.Helper()
	c := e.claim(req)
	e.requireState(idempotency.Completed, c, what)
	require.Equal(e.t, opID, c.OperationID, "%s: operation ID", what)
	requireResponse(e.t, want, c.Response, what)
}

// requireFenced asserts that every call that changes a record is refused
// with ErrFenced for token. It tries Forget last, so that a store that
// wrongly accepts it shows up in the caller's next assertion.
func (e *env) requireFenced(k idempotency.Key, token uint64, what string) {
	e.t.Helper()
	err := e.store.Heartbeat(e.ctx, k, token, longLease)
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: Heartbeat with token %d", what, token)
	stale := idempotency.Response{Status: http.StatusTeapot, Body: []byte("written by a stale owner")}
	err = e.store.Complete(e.ctx, k, token, stale, longRetention)
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: Complete with token %d", what, token)
	err = e.store.Abandon(e.ctx, k, token)
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: Abandon with token %d", what, token)
	err = e.store.Release(e.ctx, k, token)
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: Release with token %d", what, token)
	err = e.store.Forget(e.ctx, k, token)
	require.ErrorIs(e.t, err, idempotency.ErrFenced, "%s: Forget with token %d", what, token)
}

func (e *env) complete(k idempotency.Key, token uint64, resp idempotency.Response, what string) {
	e.t.Helper()
	require.NoError(e.t, e.store.Complete(e.ctx, k, token, resp, longRetention), "%s: Complete", what)
}

func (e *env) release(k idempotency.Key, token uint64, what string) {
	e.t.Helper()
	require.NoError(e.t, e.store.Release(e.ctx, k, token), "%s: Release", what)
}

func (e *env) forget(k idempotency.Key, token uint64, what string) {
	e.t.Helper()
	require.NoError(e.t, e.store.Forget(e.ctx, k, token), "%s: Forget", what)
}

func (e *env) subscribe(k idempotency.Key) idempotency.Subscription {
	e.t.Helper()
	sub, err := e.store.Subscribe(e.ctx, k)
	require.NoError(e.t, err, "Subscribe(%q)", k)
	e.t.Cleanup(sub.Close)
	return sub
}

// awaitSettled waits for sub to wake, re-claiming with req after every
// wake-up (wake-ups may be spurious), until the record is no longer in
// flight. It fails when no wake-up settles it within wakeTimeout.
func (e *env) awaitSettled(sub idempotency.Subscription, req idempotency.ClaimRequest, what string) idempotency.Claim {
	e.t.Helper()
	deadline := time.NewTimer(wakeTimeout)
	defer deadline.Stop()
	for {
		select {
		case <-sub.C():
		case <-deadline.C:
			e.t.Fatalf("%s: the subscription was not woken within %v", what, wakeTimeout)
		}
		if c := e.claim(req); c.State != idempotency.InFlight {
			return c
		}
	}
}

// claimAll sends every claim at once, one goroutine each, with every
// function of alongside in a goroutine of its own, and returns the answers
// in the order of reqs once all are done.
func (e *env) claimAll(reqs []idempotency.ClaimRequest, alongside ...func()) []idempotency.Claim {
	e.t.Helper()
	start := make(chan struct{})
	cs := make([]idempotency.Claim, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for _, f := range alongside {
		wg.Go(func() {
			<-start
			f()
		})
	}
	for i, req := range reqs {
		wg.Go(func() {
			<-start
			cs[i], errs[i] = e.store.Claim(e.ctx, req)
		})
	}
	close(start)
	wg.Wait()
	require.NoError(e.t, errors.Join(errs...), "concurrent claims")
	return cs
}

// requireOneOwner asserts that exactly one of the concurrent claims cs
// became the owner and that every other one saw it in flight, or a mismatch
// when its fingerprint differs from the owner's. It returns the owner's
// index.
func (e *env) requireOneOwner(reqs []idempotency.ClaimRequest, cs []idempotency.Claim, what string) int {
	e.t.Helper()
	owner := -1
	for i, c := range cs {
		if c.State == idempotency.Owner {
			require.Equal(e.t, -1, owner, "%s: claims %d and %d both became the owner", what, owner, i)
			owner = i
		}
	}
	require.NotEqual(e.t, -1, owner, "%s: no claim became the owner", what)
	for i, c := range cs {
		if i == owner {
			continue
		}
		want := idempotency.InFlight
		if reqs[i].Fingerprint != reqs[owner].Fingerprint {
			want = idempotency.Mismatch
		}
		e.requireState(want, c, fmt.Sprintf("%s: claim %d (owner: claim %d)", what, i, owner))
	}
	return owner
}

// racers returns n claims of k, each with an operation ID of its own.
func racers(n int, k idempotency.Key, fp idempotency.Fingerprint) []idempotency.ClaimRequest {
	reqs := make([]idempotency.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = request(k, fp)
	}
	return reqs
}

func requireResponse(t *testing.T, want, got idempotency.Response, what string) {
	t.Helper()
	require.Equal(t, want.Status, got.Status, "%s: status", what)
	if len(want.Header) == 0 {
		require.Empty(t, got.Header, "%s: header", what)
	} else {
		require.Equal(t, want.Header, got.Header, "%s: header", what)
	}
	if !bytes.Equal(want.Body, got.Body) {
		i := 0
		for i < len(want.Body) && i < len(got.Body) && want.Body[i] == got.Body[i] {
			i++
		}
		t.Fatalf("%s: body: got %d bytes, want %d; they differ from byte %d", what, len(got.Body), len(want.Body), i)
	}
}

func cloneResponse(r idempotency.Response) idempotency.Response {
	return idempotency.Response{Status: r.Status, Header: r.Header.Clone(), Body: bytes.Clone(r.Body)}
}

func stateName(s idempotency.ClaimState) string {
	switch s {
	case idempotency.Owner:
		return "Owner"
	case idempotency.Completed:
		return "Completed"
	case idempotency.InFlight:
		return "InFlight"
	case idempotency.Mismatch:
		return "Mismatch"
	}
	return fmt.Sprintf("ClaimState(%d)", int(s))
}

// 1. A claim on no record creates it: the caller owns it, at attempt 1,
// under the operation ID it brought.
func claimCreatesRecord(e *env) {
	req := request(e.key("fresh"), fingerprint("a"))
	e.own(req, 1, req.OperationID, "first claim")

	// A second fresh key gets its own record and its own operation ID.
	other := request(e.key("fresh"), fingerprint("a"))
	e.own(other, 1, other.OperationID, "first claim of another key")
}

// 2. While the owner's lease is live, every other claim, watching or not,
// finds the record in flight and changes nothing.
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

// 3. A claim with another fingerprint is a mismatch whatever the record's
// state, and takes nothing from the record's request.
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

// 4. A completed record replays exactly the stored response: status, every
// header value in order, the body byte for byte, under the operation ID of
// its first claim.
func completeThenReplay(e *env) {
	binary := make([]byte, 0, 261)
	for i := range 256 {
		binary = append(binary, byte(i))
	}
	binary = append(binary, 0xff, 0xfe, 0x00, 0xc3, 0x28) // invalid UTF-8
	large := make([]byte, 256<<10)
	for i := range large {
		large[i] = byte(i*7 + i>>8)
	}
	responses := []struct {
		name string
		resp idempotency.Response
	}{
		{"HeadersAndBinaryBody", idempotency.Response{Status: http.StatusCreated, Header: http.Header{
			"Content-Type": {"application/octet-stream"},
			"Link":         {`</a>; rel="first"`, `</b>; rel="second"`, `</c>; rel="third"`},
			"X-Order":      {"3", "1", "2"},
			"X-Empty":      {""},
		}, Body: binary}},
		{"NoHeadersNoBody", idempotency.Response{Status: http.StatusNoContent}},
		{"HeadersEmptyBody", idempotency.Response{Status: http.StatusAccepted,
			Header: http.Header{"Location": {"/charges/ch_1"}}, Body: []byte{}}},
		{"LargeBody", idempotency.Response{Status: http.StatusOK,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: large}},
		{"ClientError", idempotency.Response{Status: http.StatusNotFound,
			Header: http.Header{"Content-Type": {"application/problem+json"}}, Body: []byte(`{"status":404}`)}},
	}
	for _, r := range responses {
		e.run(r.name, func(e *env) {
			k, fp := e.key("replay"), fingerprint("a")
			first := request(k, fp)
			owner := e.own(first, 1, first.OperationID, "first claim")
			resp := cloneResponse(r.resp)
			e.complete(k, owner.Token, resp, "the owner")
			// The store keeps its own copy: the caller may reuse its buffers.
			for _, vs := range resp.Header {
				for i := range vs {
					vs[i] = "overwritten by the caller"
				}
			}
			for i := range resp.Body {
				resp.Body[i] ^= 0xff
			}
			e.requireReplay(request(k, fp), first.OperationID, r.resp, "first replay")
			e.requireReplay(request(k, fp), first.OperationID, r.resp, "second replay")
		})
	}
}

// 5. Once the owner's lease has run out, the same request takes the record
// over: attempt 2, the same operation ID, a greater token; exactly one of
// many concurrent claims does. An owner whose lease ran out but whom nobody
// took over still holds the current token.
func takeoverAfterLeaseExpiry(e *env) {
	fp := fingerprint("a")
	shortClaim := func(label string) (idempotency.ClaimRequest, idempotency.Claim) {
		req := request(e.key(label), fp)
		req.Lease = e.lease
		return req, e.own(req, 1, req.OperationID, "first claim, with a short lease")
	}
	single, singleOwner := shortClaim("takeover")
	raced, racedOwner := shortClaim("takeover-race")
	late, lateOwner := shortClaim("late-owner")
	e.wait(e.past)

	e.requireState(idempotency.Mismatch, e.claim(request(single.Key, fingerprint("b"))),
		"claim with another fingerprint after the lease ran out")
	c := e.own(request(single.Key, fp), 2, single.OperationID, "claim after the lease ran out")
	require.Greater(e.t, c.Token, singleOwner.Token, "the takeover's token must be greater than the first owner's")
	e.requireInFlight(request(single.Key, fp), longLease, "claim after the takeover")

	reqs := racers(claimers, raced.Key, fp)
	cs := e.claimAll(reqs)
	c = cs[e.requireOneOwner(reqs, cs, "concurrent claims after the lease ran out")]
	e.requireOwner(c, 2, raced.OperationID, "the concurrent takeover")
	require.Greater(e.t, c.Token, racedOwner.Token, "the concurrent takeover's token must be greater than the first owner's")

	want := idempotency.Response{Status: http.StatusOK, Body: []byte("late but unopposed")}
	e.complete(late.Key, lateOwner.Token, want, "an owner whose lease ran out, not taken over")
	e.requireReplay(request(late.Key, fp), late.OperationID, want, "claim after the late owner completed")
}

// 6. After a release the next claim takes over with the same operation ID;
// after a release with forget the key is free for any request, which gets a
// new record and its own operation ID.
func releaseThenClaim(e *env) {
	e.run("Release", func(e *env) {
		k, fp := e.key("release"), fingerprint("a")
		first := request(k, fp)
		c1 := e.own(first, 1, first.OperationID, "first claim")
		e.release(k, c1.Token, "the first owner")
		c2 := e.own(request(k, fp), 2, first.OperationID, "claim after release")
		require.Greater(e.t, c2.Token, c1.Token, "the second owner's token must be greater than the first's")
		e.release(k, c2.Token, "the second owner")
		reqs := racers(claimers, k, fp)
		cs := e.claimAll(reqs)
		c3 := cs[e.requireOneOwner(reqs, cs, "concurrent claims after release")]
		e.requireOwner(c3, 3, first.OperationID, "the concurrent claim after release")
		require.Greater(e.t, c3.Token, c2.Token, "the third owner's token must be greater than the second's")
	})
	e.run("Forget", func(e *env) {
		k := e.key("forget")
		first := request(k, fingerprint("a"))
		c1 := e.own(first, 1, first.OperationID, "first claim")
		e.forget(k, c1.Token, "the first owner")
		second := request(k, fingerprint("b"))
		c2 := e.own(second, 1, second.OperationID, "claim with another fingerprint after release with forget")
		require.Greater(e.t, c2.Token, c1.Token, "the new record's token must be greater than every earlier token of the key")
		e.requireState(idempotency.Mismatch, e.claim(request(k, fingerprint("a"))),
			"claim with the forgotten record's fingerprint on the new record")
		e.requireFenced(k, c1.Token, "the forgotten record's owner")
		e.requireInFlight(request(k, fingerprint("b")), longLease, "claim after the forgotten record's owner was fenced")
	})
}

// 7. Only the current owner's token changes a record; every other token is
// fenced and changes nothing.
func fencing(e *env) {
	fp := fingerprint("a")
	want := idempotency.Response{Status: http.StatusCreated, Body: []byte("the owner's")}
	e.run("AfterTakeover", func(e *env) {
		k := e.key("fenced")
		first := request(k, fp)
		first.Lease = e.lease
		old := e.own(first, 1, first.OperationID, "first claim, with a short lease")
		e.wait(e.past)
		cur := e.own(request(k, fp), 2, first.OperationID, "takeover")
		e.requireFenced(k, old.Token, "the taken-over owner")
		e.requireInFlight(request(k, fp), longLease, "claim after the taken-over owner was fenced")
		require.NoError(e.t, e.store.Heartbeat(e.ctx, k, cur.Token, longLease), "the new owner's Heartbeat")
		e.complete(k, cur.Token, want, "the new owner")
		e.requireFenced(k, old.Token, "the taken-over owner, after the new owner completed")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after the new owner completed")
	})
	e.run("CompleteTwice", func(e *env) {
		k := e.key("twice")
		first := request(k, fp)
		c := e.own(first, 1, first.OperationID, "first claim")
		e.complete(k, c.Token, want, "the owner")
		e.requireFenced(k, c.Token, "the owner, after it completed")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after the second Complete")
	})
	e.run("AfterRelease", func(e *env) {
		k := e.key("released")
		first := request(k, fp)
		c := e.own(first, 1, first.OperationID, "first claim")
		e.release(k, c.Token, "the owner")
		e.requireFenced(k, c.Token, "the owner, after it released")
		e.own(request(k, fp), 2, first.OperationID, "claim after release")
	})
	e.run("MissingRecord", func(e *env) {
		k := e.key("missing")
		e.requireFenced(k, 1, "a key never claimed")
		req := request(k, fp)
		e.own(req, 1, req.OperationID, "first claim, after the fenced calls")
	})
	e.run("ZeroToken", func(e *env) {
		k := e.key("zero")
		first := request(k, fp)
		c := e.own(first, 1, first.OperationID, "first claim")
		e.requireFenced(k, 0, "token 0")
		e.requireInFlight(request(k, fp), longLease, "claim after the calls with token 0")
		e.complete(k, c.Token, want, "the owner")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after completion")
	})
	e.run("OtherKeysToken", func(e *env) {
		k, other := e.key("target"), e.key("other")
		first := request(k, fp)
		c := e.own(first, 1, first.OperationID, "first claim")
		otherReq := request(other, fp)
		foreign := e.own(otherReq, 1, otherReq.OperationID, "first claim of the other key").Token
		// Tokens are ordered per key only, so two keys may hold the same
		// number (a Redis Cluster store cannot share one counter across
		// slots); the other key's next token then differs from k's.
		if foreign == c.Token {
			e.release(other, foreign, "the other key's owner")
			foreign = e.own(request(other, fp), 2, otherReq.OperationID, "claim of the other key after release").Token
		}
		e.requireFenced(k, foreign, "another key's token")
		e.requireInFlight(request(k, fp), longLease, "claim after the calls with another key's token")
		e.complete(k, c.Token, want, "the owner")
		e.requireReplay(request(k, fp), first.OperationID, want, "claim after completion")
	})
}

// 8. A heartbeat sets the owner's lease to a full lease from the heartbeat:
// the record stays in flight past the original lease, until the renewed one
// runs out.
func heartbeatExtendsLease(e *env) {
	k, fp := e.key("heartbeat"), fingerprint("a")
	first := request(k, fp)
	first.Lease = e.lease
	c1 := e.own(first, 1, first.OperationID, "first claim, with a short lease")
	e.wait(e.lease / 2)
	require.NoError(e.t, e.store.Heartbeat(e.ctx, k, c1.Token, 2*e.lease), "the owner's Heartbeat")
	e.wait(e.lease)
	// At least a lease has passed since the heartbeat: at most one of its two
	// leases is left.
	e.requireInFlight(request(k, fp), e.lease, "claim after the original lease ran out, within the renewed one")
	e.wait(e.past)
	c2 := e.own(request(k, fp), 2, first.OperationID, "claim after the renewed lease ran out")
	require.Greater(e.t, c2.Token, c1.Token, "the takeover's token must be greater than the first owner's")
	require.ErrorIs(e.t, e.store.Heartbeat(e.ctx, k, c1.Token, longLease), idempotency.ErrFenced,
		"the first owner's Heartbeat after the takeover")
}

// 9. A record is gone once its retention has passed, completed or still in
// flight; the key's next token is still greater than every earlier one, so
// an owner from before the expiry is fenced on the record made again.
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

// A takeover near the end of a record's retention must not lose the record
// while the new owner runs: the claim's retention applies from the takeover.
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

// 10. Subscribers of a record are woken when a watched record is settled,
// and a closed subscription is not.
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
	// and returns its error once it is done. Subscribers read C only then:
	// a wake-up must be kept for a waiter that is busy at that moment.
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
		// The open subscription's wake-up has arrived; the closed one's
		// would have come with it.
		select {
		case _, ok := <-closed.C():
			require.False(e.t, ok, "a closed subscription was woken")
		case <-time.After(100 * time.Millisecond):
		}
	})
}

// 11. Of many concurrent claims of a fresh key, exactly one becomes the
// owner, with its own operation ID; the others find it in flight, or a
// mismatch when their request differs.
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

// 12. A Guard over the store runs an operation once for many concurrent
// callers, and runs it again, as a takeover of the same operation, after it
// failed.
func guard(e *env) {
	// The long recheck interval leaves the store's wake-ups as the only way a
	// waiter learns the outcome in time.
	g := idempotency.New(e.store, idempotency.Options{Lease: longLease, WaitTimeout: wakeTimeout, RecheckInterval: time.Hour})
	fp := fingerprint("a")
	want := idempotency.Response{Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}
	e.run("RunsOnce", func(e *env) {
		k := e.key("guard")
		var runs, calling atomic.Int32
		allCalling := make(chan struct{})
		results := make([]idempotency.Result, claimers)
		errs := make([]error, claimers)
		var wg sync.WaitGroup
		for i := range claimers {
			wg.Go(func() {
				if calling.Add(1) == claimers {
					close(allCalling)
				}
				results[i], errs[i] = g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
					runs.Add(1)
					// Hold the record until every caller has come, so that
					// most of them wait for it.
					<-allCalling
					return want, nil
				})
			})
		}
		wg.Wait()
		require.NoError(e.t, errors.Join(errs...), "concurrent Do")
		require.EqualValues(e.t, 1, runs.Load(), "runs of fn")
		require.NotEmpty(e.t, results[0].OperationID, "Do's operation ID")
		replayed := 0
		for i, r := range results {
			requireResponse(e.t, want, r.Response, fmt.Sprintf("Do %d", i))
			require.Equal(e.t, results[0].OperationID, r.OperationID, "Do %d: operation ID", i)
			if r.Replayed {
				replayed++
			}
		}
		require.Equal(e.t, claimers-1, replayed, "replayed results")
	})
	e.run("RetryAfterError", func(e *env) {
		k := e.key("guard-retry")
		type attempt struct {
			ok          bool
			operationID string
			attempt     int
			token       uint64
			takeover    bool
		}
		seen := func(ctx context.Context) attempt {
			i, ok := idempotency.FromContext(ctx)
			if !ok {
				return attempt{}
			}
			return attempt{true, i.OperationID, i.Attempt, i.Token, i.Takeover}
		}
		var first, second attempt
		boom := errors.New("the provider timed out")
		_, err := g.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
			first = seen(ctx)
			return idempotency.Response{}, boom
		})
		require.ErrorIs(e.t, err, boom, "Do whose fn failed")
		require.True(e.t, first.ok, "fn's context carries no Info")
		require.Equal(e.t, 1, first.attempt, "the first attempt's number")
		require.False(e.t, first.takeover, "the first attempt's Takeover")

		res, err := g.Do(e.ctx, k, fp, func(ctx context.Context) (idempotency.Response, error) {
			second = seen(ctx)
			return want, nil
		})
		require.NoError(e.t, err, "Do after the failed attempt")
		require.True(e.t, second.ok, "fn's context carries no Info")
		require.Equal(e.t, first.operationID, second.operationID, "the retry's operation ID")
		require.Equal(e.t, 2, second.attempt, "the retry's attempt number")
		require.True(e.t, second.takeover, "the retry's Takeover")
		require.Greater(e.t, second.token, first.token, "the retry's token must be greater than the first attempt's")
		require.False(e.t, res.Replayed, "the retry's Replayed")
		require.Equal(e.t, first.operationID, res.OperationID, "the retry's Result.OperationID")
		requireResponse(e.t, want, res.Response, "the retry's response")

		res, err = g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) {
			e.t.Error("fn ran for a completed record")
			return idempotency.Response{}, nil
		})
		require.NoError(e.t, err, "Do after completion")
		require.True(e.t, res.Replayed, "Replayed after completion")
		require.Equal(e.t, first.operationID, res.OperationID, "Result.OperationID after completion")
		requireResponse(e.t, want, res.Response, "the replayed response")
	})
	e.run("Mismatch", func(e *env) {
		k := e.key("guard-mismatch")
		_, err := g.Do(e.ctx, k, fp, func(context.Context) (idempotency.Response, error) { return want, nil })
		require.NoError(e.t, err, "first Do")
		_, err = g.Do(e.ctx, k, fingerprint("b"), func(context.Context) (idempotency.Response, error) {
			e.t.Error("fn ran for a request that does not match the record")
			return idempotency.Response{}, nil
		})
		require.ErrorIs(e.t, err, idempotency.ErrMismatch, "Do with another fingerprint")
	})
}

// 13. Every Key is a record of its own: the scope separates equal names,
// and no choice of characters in scope or name makes two keys meet.
func keysAndScopes(e *env) {
	u := rand.Text() // keeps the keys apart from earlier runs on a shared store
	keys := []idempotency.Key{
		{Scope: u, Name: "n"},
		{Scope: u + "-other", Name: "n"},
		{Scope: "", Name: u + "-n"},
		// Pairs that would meet if scope and name were joined with ':'.
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
		// A fingerprint of its own: a record reached through another key
		// shows up as a mismatch.
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

// 14. A claim that takes a record over says whether the previous attempt
// was abandoned, its lease run out unsettled, rather than released; a claim
// that makes a record, even in place of a forgotten or expired one, never
// does. When the late owner releases while claims race to take over, the
// winner's answer agrees with whichever came first.
func abandonedTakeover(e *env) {
	fp := fingerprint("a")
	short := func(label string) (idempotency.ClaimRequest, idempotency.Claim) {
		req := request(e.key(label), fp)
		req.Lease = e.lease
		return req, e.own(req, 1, req.OperationID, "first claim, with a short lease")
	}
	expired, _ := short("expired")
	released, releasedOwner := short("released")
	e.release(released.Key, releasedOwner.Token, "the owner of the record to release")
	forgotten, forgottenOwner := short("forgotten")
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
		races[i].req, races[i].owner = short("release-race")
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
		// Fenced: a claim took the record over before the release, while it
		// was abandoned; otherwise the release came first.
		e.requireAbandoned(cs[w], err != nil, fmt.Sprintf("%s: the winner, the late owner's Release returning %v", what, err))
	}
}

// 15. Abandon gives the record up unsettled: it stays
// in flight, listed as abandoned, and the next claim takes it over at once
// as an abandoned record, with the same operation ID. The owner that gave it
// up is fenced from then on, and cannot give up its successor's lease.
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

// 16. Abandoned lists the records in flight whose lease ran out, each once
// with its fingerprint, and no other: not one under a live or renewed lease,
// completed, released, or past its retention, nor one since taken over or
// settled by its late owner. It returns at most limit records.
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
	// Made last, so that it is kept a lease's length past the first wait,
	// and surely not past the second.
	expiring := newRecord("expiring", e.lease, e.lease+e.past)
	e.wait(e.past)

	want := map[idempotency.Key]idempotency.Fingerprint{expiring.req.Key: expiring.req.Fingerprint}
	for _, r := range abandoned {
		want[r.req.Key] = r.req.Fingerprint
	}
	got := e.listed(keys...)
	require.Equal(e.t, want, got, "records listed once the short leases ran out")
	const limit = 2
	list, err := e.store.Abandoned(e.ctx, limit)
	require.NoError(e.t, err, "Abandoned(%d)", limit)
	// Other cases' records may fill the page: only the bounds hold.
	require.NotEmpty(e.t, list, "Abandoned(%d), with %d records of this case abandoned", limit, len(want))
	require.LessOrEqual(e.t, len(list), limit, "Abandoned(%d)", limit)
	for _, a := range list {
		if slices.Contains(keys, a.Key) {
			require.Contains(e.t, want, a.Key, "Abandoned(%d) listed a record not abandoned", limit)
			require.Equal(e.t, want[a.Key], a.Fingerprint, "Abandoned(%d) listed %q", limit, a.Key)
		}
	}

	// A sweeper claims with what the listing gave.
	swept := abandoned[0].req.Key
	c := e.own(idempotency.ClaimRequest{Key: swept, Fingerprint: got[swept], OperationID: "op-sweeper",
		Lease: longLease, Retention: longRetention}, 2, abandoned[0].req.OperationID, "a sweeper's claim of a listed record")
	e.requireAbandoned(c, true, "a sweeper's claim of a listed record")
	// Late owners keep their tokens until taken over.
	e.complete(abandoned[1].req.Key, abandoned[1].owner.Token, resp, "a late owner")
	e.release(abandoned[2].req.Key, abandoned[2].owner.Token, "a late owner")
	still := map[idempotency.Key]idempotency.Fingerprint{abandoned[3].req.Key: abandoned[3].req.Fingerprint}
	require.Equal(e.t, still, e.listed(kept...), "records listed after a takeover and two late settlements")

	e.wait(e.past)
	require.Equal(e.t, still, e.listed(keys...), "records listed after the expiring record's retention ran out")
}
