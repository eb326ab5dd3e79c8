package idempotencytest

import (
	"net/http"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

// completeThenReplay checks that a claim of a completed record replays
// exactly the response the owner stored, under the operation ID of the first
// claim: the status, every header value in order, and the body byte for
// byte, for binary, empty and large bodies. The store keeps its own copy,
// so the caller may overwrite its buffers after Complete.
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

// releaseThenClaim checks that after Release the next claim becomes the
// owner at the next attempt, with the same operation ID and a greater token,
// and that exactly one of many concurrent claims does. After Forget the
// record is gone: a claim with any fingerprint makes a new record at
// attempt 1 under its own operation ID, with a token greater than every
// earlier one of the key, and the forgotten record's owner is fenced.
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

// fencing checks that only the current owner's token changes a record.
// Heartbeat, Complete, Abandon, Release and Forget are refused with
// ErrFenced, and change nothing, for the token of an owner that was taken
// over or has already completed or released, for a token of a key that has
// no record, for token 0, and for a token of another key.
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
