package idempotency

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
)

// ProblemTypes is the prefix of every Problem.Type: a page that explains each
// error answer under an anchor named by its Problem.Code.
const ProblemTypes = "https://github.com/idempotency-go/idempotency/blob/main/docs/errors.md#"

// Problem is an error answer of the middleware, as an RFC 9457 problem
// details object. Code names the problem (see Guard.Middleware for the list)
// and Type is ProblemTypes + Code; Status is the HTTP status it is sent with.
// Detail is written for the API's client and never holds a store's error
// text, which may name internal hosts.
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail"`
	Code   string `json:"code"`
}

// ProblemDetails writes p as RFC 9457 problem details
// (application/problem+json) with p.Status. It is the middleware's default
// MiddlewareOptions.Errors.
func ProblemDetails(w http.ResponseWriter, _ *http.Request, p Problem) {
	body, _ := json.Marshal(p) // strings and an int: cannot fail
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}

// StripeErrors writes p as Stripe's API writes its errors, for an API that
// follows Stripe's conventions and whose clients use Stripe's SDKs, which
// read an error only from a body with an "error" member: the body is
// {"error": {"type", "code", "message", "doc_url"}}, its type
// idempotency_error for a problem with the key, invalid_request_error for one
// with the request and api_error for the store's. As Stripe's API does, it
// answers every refusal of the request itself with 400 (a key reused with
// another request, a body too large), so that the SDKs raise an idempotency
// or invalid-request error for it; 409 and 503 keep their status, with
// Stripe-Should-Retry: true, since a retry under the same key can succeed
// (stripe-node retries them, stripe-go raises them); every other answer
// carries Stripe-Should-Retry: false.
func StripeErrors(w http.ResponseWriter, _ *http.Request, p Problem) {
	status, kind := p.Status, "invalid_request_error"
	switch p.Code {
	case codeKeyReused:
		status, kind = http.StatusBadRequest, "idempotency_error"
	case codeBodyTooLarge:
		status = http.StatusBadRequest
	case codeMissingKey, codeRepeatedKey, codeInvalidKey, codeKeyExpired, codeInFlight:
		kind = "idempotency_error"
	case codeOutcomeNotRecorded, codeStoreUnavailable, codeClientGone:
		kind = "api_error"
	}
	body, _ := json.Marshal(map[string]map[string]string{"error": {
		"type": kind, "code": p.Code, "message": p.Detail, "doc_url": p.Type,
	}})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Stripe-Should-Retry", strconv.FormatBool(status == http.StatusConflict || status == http.StatusServiceUnavailable))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// The problems the middleware answers, by Problem.Code.
const (
	codeMissingKey         = "missing-key"
	codeRepeatedKey        = "repeated-key"
	codeInvalidKey         = "invalid-key"
	codeUnknownScope       = "unknown-scope"
	codeUnreadableBody     = "unreadable-body"
	codeBodyTooLarge       = "body-too-large"
	codeKeyReused          = "key-reused"
	codeKeyExpired         = "key-expired"
	codeInFlight           = "in-flight"
	codeOutcomeNotRecorded = "outcome-not-recorded"
	codeStoreUnavailable   = "store-unavailable"
	codeClientGone         = "client-gone"
)

// problemFor describes err to the client, in words meant for it: store
// failures are described without their text.
func problemFor(err error) Problem {
	p := func(code string, status int, title, detail string) Problem {
		return Problem{Type: ProblemTypes + code, Title: title, Status: status, Detail: detail, Code: code}
	}
	var tooLarge bodyTooLargeError
	switch {
	case errors.Is(err, errKeyMissing):
		return p(codeMissingKey, http.StatusBadRequest, "Idempotency-Key required",
			"This request must carry an Idempotency-Key header.")
	case errors.Is(err, errKeyRepeated):
		return p(codeRepeatedKey, http.StatusBadRequest, "Idempotency-Key repeated",
			"The Idempotency-Key header must be sent exactly once.")
	case errors.Is(err, ErrInvalidKey):
		return p(codeInvalidKey, http.StatusBadRequest, "Invalid Idempotency-Key",
			fmt.Sprintf("The Idempotency-Key must be 1 to %d visible ASCII characters, bare or as a quoted string.", MaxKeyLength))
	case errors.Is(err, errScope):
		return p(codeUnknownScope, http.StatusBadRequest, "Request scope unknown",
			"The request does not identify the account its Idempotency-Key belongs to.")
	case errors.Is(err, errBodyUnreadable):
		return p(codeUnreadableBody, http.StatusBadRequest, "Request body unreadable",
			"The request body could not be read.")
	case errors.As(err, &tooLarge):
		return p(codeBodyTooLarge, http.StatusRequestEntityTooLarge, "Request body too large",
			fmt.Sprintf("The request body exceeds %d bytes.", tooLarge.limit))
	case errors.Is(err, errClientGone):
		return p(codeClientGone, statusClientClosedRequest, "Client closed request",
			"The client went away before the answer.")
	case errors.Is(err, ErrKeyExpired):
		return p(codeKeyExpired, http.StatusBadRequest, "Idempotency-Key expired",
			"This Idempotency-Key is older than the server keeps answers for, and its answer is gone; the request did not run. Check whether the operation happened, then use a new key.")
	case errors.Is(err, ErrMismatch):
		return p(codeKeyReused, http.StatusUnprocessableEntity, "Idempotency-Key reused",
			"This Idempotency-Key was used before with a different request.")
	case errors.Is(err, ErrInFlight):
		return p(codeInFlight, http.StatusConflict, "Request in progress",
			"A request with this Idempotency-Key is still in progress; retry later with the same key.")
	case errors.Is(err, ErrFenced):
		return p(codeOutcomeNotRecorded, http.StatusServiceUnavailable, "Outcome not recorded",
			"This attempt lost its hold on the Idempotency-Key before its outcome was recorded; retry with the same key.")
	}
	return p(codeStoreUnavailable, http.StatusServiceUnavailable, "Idempotency store unavailable",
		"The outcome of this request could not be looked up or recorded; retry later with the same key.")
}

// fail answers err as a problem, in the format MiddlewareOptions.Errors
// writes. Cache-Control and Retry-After are the middleware's, set first, so
// that clients and proxies read every format alike: 409 and 503 say when to
// retry.
func (h *guarded) fail(w http.ResponseWriter, r *http.Request, err error) {
	p := problemFor(err)
	hd := w.Header()
	hd.Set("Cache-Control", "no-store")
	if p.Status == http.StatusConflict || p.Status == http.StatusServiceUnavailable {
		hd.Set("Retry-After", h.retryAfterSecs)
	}
	h.o.Errors(w, r, p)
}
