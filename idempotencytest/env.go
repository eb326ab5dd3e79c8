package idempotencytest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

const (
	longLease     = time.Minute // a lease that never runs out during a case
	longRetention = time.Hour   // a retention that never runs out during a case
	wakeTimeout   = 5 * time.Second
	claimers      = 50 // goroutines that race for one record
	// listAll is a limit for ListAbandoned above every record a shared store
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

// ownShortLease makes a record of label owned under a lease that the case
// lets run out, and returns the claim's request and its answer.
func (e *env) ownShortLease(label string, fp idempotency.Fingerprint) (idempotency.ClaimRequest, idempotency.Claim) {
	req := request(e.key(label), fp)
	req.Lease = e.lease
	return req, e.own(req, 1, req.OperationID, "first claim, with a short lease")
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

// listed returns the records of keys that ListAbandoned lists, with their
// fingerprints. The store may hold other cases' abandoned records, so it
// asks for every record and leaves the others' out.
func (e *env) listed(keys ...idempotency.Key) map[idempotency.Key]idempotency.Fingerprint {
	e.t.Helper()
	list, err := e.store.ListAbandoned(e.ctx, listAll)
	require.NoError(e.t, err, "ListAbandoned(%d)", listAll)
	got := make(map[idempotency.Key]idempotency.Fingerprint)
	for _, a := range list {
		if !slices.Contains(keys, a.Key) {
			continue
		}
		_, twice := got[a.Key]
		require.False(e.t, twice, "ListAbandoned(%d) listed %q twice", listAll, a.Key)
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
