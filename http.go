package idempotency

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Header fields the middleware reads and writes.
const (
	// HeaderKey carries the client's idempotency key, as an RFC 8941
	// sf-string ("abc") or bare (abc).
	HeaderKey = "Idempotency-Key"
	// HeaderReplayed is set to "true" on a response replayed from the
	// record instead of produced by the handler for this request.
	HeaderReplayed = "Idempotent-Replayed"
	// HeaderBodyOmitted is set on a replayed response whose body is not the
	// original's: "too-large" when it was over
	// MiddlewareOptions.MaxResponseBytes and so not stored, or the reason
	// MiddlewareOptions.Stored gave ("omitted" for OmitBody).
	HeaderBodyOmitted = "Idempotent-Body-Omitted"
)

// MiddlewareOptions configures Guard.Middleware. The zero value of every
// field is its documented default.
type MiddlewareOptions struct {
	// Methods are the guarded request methods, compared case-sensitively;
	// requests with other methods pass through untouched. Default POST and
	// PATCH.
	Methods []string
	// OptionalKey lets a guarded request without an Idempotency-Key pass
	// through unguarded. Default false: such a request gets 400.
	OptionalKey bool
	// Scope returns the scope of the request's key: the account or tenant
	// it belongs to, so that two tenants never share a record whatever keys
	// their clients choose. An error answers 400 (unknown-scope), and the
	// error's text is not sent; so does an empty scope, which would put the
	// request in one scope with every other request that names no account.
	// Required: Middleware panics without it, so that no API shares keys
	// between its tenants by omission; an API with a single tenant says so
	// with SingleTenant, the one Scope whose empty scope is served.
	Scope func(r *http.Request) (string, error)
	// MaxRequestBytes bounds the request body, which is read whole before
	// the handler runs to fingerprint it. A larger body answers 413 and
	// nothing is stored. Default 1 MiB.
	MaxRequestBytes int64
	// MaxResponseBytes bounds the response body buffered until its outcome
	// is stored. A handler that writes more never runs twice and never
	// makes the middleware hold more: the moment its body outgrows the
	// limit, the record is settled with the handler's status and header
	// fields, no body, no Content-Length and "Idempotent-Body-Omitted:
	// too-large"; only then is the response streamed to this client, body
	// and all. A retry receives that bodiless response, marked replayed.
	// The disposition is decided at that moment too: a SetDisposition
	// after it has no effect. Default 1 MiB.
	MaxResponseBytes int64
	// FingerprintHeaders names request header fields that are part of the
	// fingerprint besides the method, path and body. Default none: fields
	// that change per attempt (timestamps, trace ids) must never be named.
	FingerprintHeaders []string
	// Disposition chooses, from the handler's status, what becomes of the
	// record; a handler's own SetDisposition wins. Default
	// DefaultDisposition.
	Disposition func(status int) Disposition
	// FailOpen runs the handler unguarded when the store cannot be reached
	// to claim the key, giving up at-most-once for availability. It never
	// runs a handler a second time: once the handler ran, a failure to
	// store its outcome answers 503. Default false: 503 and the handler
	// does not run.
	FailOpen bool
	// RetryAfter is sent in Retry-After with 409 (still in flight) and 503
	// (store unavailable, outcome not stored), in whole seconds rounded
	// up, at least 1. Default 1s.
	RetryAfter time.Duration
	// Stored, when set, chooses what the record keeps of the handler's
	// response, for routes whose answers carry secrets (an API key minted
	// by a POST, a one-time credential): the client whose request ran the
	// handler gets the response whole; the record, and so every replay,
	// gets what Stored returns. A non-empty omitted is sent on replays as
	// Idempotent-Body-Omitted, so that they say what they lack. Stored gets
	// a copy of the response to change as it likes. OmitBody keeps the
	// status and header fields only. Default nil: the response is kept
	// whole.
	Stored func(r *http.Request, resp Response) (kept Response, omitted string)
	// OtherFingerprintHeaders lists the FingerprintHeaders of other
	// instances of the service that share the store: during a deploy that
	// changes FingerprintHeaders, the old list on the new instances and the
	// new one on the old. A retry whose record was made under one of them
	// is replayed or resumed rather than refused with 422, as is one whose
	// record was made by the former release's rules (docs/upgrading.md). A
	// request that matches under none is refused as before. They cost
	// nothing until a key's fingerprint mismatches.
	OtherFingerprintHeaders [][]string
	// KeyTime, when set, tells when the request's key was made: UUIDv7Time
	// reads it from a UUIDv7 key, and a function of one's own can read a
	// header the client sends with its first attempt. A request whose key
	// is older than Options.Retention and has no record left is refused
	// with 400 (key-expired, ErrKeyExpired) instead of running again: its
	// first attempt's answer may have expired with the record. A record
	// still kept is replayed or resumed as usual. ok false: not known, and
	// the request is served as any other. Default nil: never refused.
	KeyTime func(r *http.Request, key string) (made time.Time, ok bool)
	// Errors writes every error answer: its status, Content-Type and body,
	// from the Problem. Cache-Control: no-store and, with 409 and 503,
	// Retry-After are set before it is called. Default ProblemDetails
	// (RFC 9457); StripeErrors answers as Stripe's API does, for clients
	// that use Stripe's SDKs.
	Errors func(w http.ResponseWriter, r *http.Request, p Problem)
}

func (o MiddlewareOptions) withDefaults() MiddlewareOptions {
	if len(o.Methods) == 0 {
		o.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	o.Methods = slices.Clone(o.Methods)
	o.FingerprintHeaders = slices.Clone(o.FingerprintHeaders)
	if o.Errors == nil {
		o.Errors = ProblemDetails
	}
	if o.MaxRequestBytes <= 0 {
		o.MaxRequestBytes = 1 << 20
	}
	if o.MaxResponseBytes <= 0 {
		o.MaxResponseBytes = 1 << 20
	}
	if o.Disposition == nil {
		o.Disposition = DefaultDisposition
	}
	if o.RetryAfter <= 0 {
		o.RetryAfter = time.Second
	}
	return o
}

// DefaultDisposition is the middleware's default policy: 5xx releases the
// key for a retry; 400, 401, 403, 408, 409, 422 and 429 forget it, since
// the client may correct the request or its credentials and reuse the key
// (a kept refusal would be replayed to it for the whole retention); any
// other status is kept and replayed. A refusal of an operation that may
// have had an effect (a retry after a 5xx, a takeover, an attempt that
// began a Step) releases the key instead of forgetting it (see Forget).
func DefaultDisposition(status int) Disposition {
	switch {
	case status >= 500:
		return Release
	case status == http.StatusBadRequest, status == http.StatusUnauthorized, status == http.StatusForbidden,
		status == http.StatusRequestTimeout, status == http.StatusConflict,
		status == http.StatusUnprocessableEntity, status == http.StatusTooManyRequests:
		return Forget
	}
	return Keep
}

// Middleware returns net/http middleware that runs each guarded request
// through g.Do under the key (Scope, Idempotency-Key) and the request's
// fingerprint, so that its handler runs at most once per key and every
// retry receives the same response.
//
// The fingerprint covers the method, the escaped path, the query (its
// fields sorted by name, as a form body's), the header fields named in
// FingerprintHeaders, and the body in a canonical form where its
// Content-Type has one: JSON (application/json, application/*+json) per
// RFC 8785 (byte for byte if RFC 8785 would write a number in it as
// another decimal value, rounded to a double's shortest digits), and
// application/x-www-form-urlencoded by field name, keeping the order of
// each name's values. Any other body
// counts byte for byte, multipart/form-data with its boundary: a client
// must resend the same bytes, as http.Request.GetBody does.
//
// The handler's response is buffered and stored before any of it is sent
// (see MaxResponseBytes for one that does not fit). A replay carries the
// stored status, header fields and body byte for byte, plus
// "Idempotent-Replayed: true". Set-Cookie, Date, Idempotent-Replayed and
// hop-by-hop fields (Connection and those it names, Keep-Alive,
// Proxy-Authenticate, Proxy-Authorization, TE, Trailer, Transfer-Encoding,
// Upgrade) are sent to the first client only, never stored; so are
// trailers. Stored fields replace same-named fields set by outer
// middleware.
//
// The handler's request context carries the attempt's Info (FromContext,
// DownstreamKey, SetDisposition work in it) and is cancelled, with a cause
// matching ErrFenced, when the lease ends (see Guard.Do): then the response
// is not stored, the client gets 503, and the handler should stop and not
// act further. A client that goes away or times out does not cancel it
// (unless Options.CancelWithCaller): the handler runs to its end and its
// outcome is stored for the client's retry, while Options.OperationTimeout
// and the lease bound it. Its request body is the buffered body.
// Flush does nothing until the outcome is stored, and Hijack fails. If the
// handler panics, the key is released before the panic goes on.
//
// Errors are RFC 9457 problem details (application/problem+json), or the
// format MiddlewareOptions.Errors writes, always with Cache-Control:
// no-store. Each Problem has a Code, and a Type that is ProblemTypes + Code:
//
//	missing-key           400  no Idempotency-Key and it is required
//	repeated-key          400  Idempotency-Key sent more than once
//	invalid-key           400  key not 1..255 visible ASCII, or a malformed sf-string
//	unknown-scope         400  Scope failed, or named no scope (not SingleTenant)
//	key-expired           400  key older than the retention, its record gone (KeyTime)
//	unreadable-body       400  the request body could not be read
//	body-too-large        413  request body over MaxRequestBytes
//	key-reused            422  key used before with a different request
//	in-flight             409  original still running after the wait; Retry-After
//	outcome-not-recorded  503  ownership lost before the outcome was stored; Retry-After
//	store-unavailable     503  the store failed; Retry-After
//	client-gone           499  the client went away before the answer (no one reads it)
//
// Middleware panics when o.Scope is nil.
func (g *Guard) Middleware(o MiddlewareOptions) func(http.Handler) http.Handler {
	if o.Scope == nil {
		panic("idempotency: MiddlewareOptions.Scope is nil: name the account a key belongs to, or use SingleTenant")
	}
	o = o.withDefaults()
	secs := max(1, int64(math.Ceil(o.RetryAfter.Seconds())))
	return func(next http.Handler) http.Handler {
		return &guarded{g: g, o: o, next: next, retryAfterSecs: strconv.FormatInt(secs, 10),
			singleTenant: reflect.ValueOf(o.Scope).Pointer() == reflect.ValueOf(SingleTenant).Pointer()}
	}
}

// SingleTenant is the MiddlewareOptions.Scope of an API with one tenant:
// every request's key is in the same scope, "".
func SingleTenant(*http.Request) (string, error) { return "", nil }

var (
	errKeyMissing     = errors.New("idempotency: Idempotency-Key header missing")
	errKeyRepeated    = errors.New("idempotency: Idempotency-Key header repeated")
	errScope          = errors.New("idempotency: no scope for the request")
	errBodyUnreadable = errors.New("idempotency: request body unreadable")
	errNotStored      = errors.New("idempotency: response discarded: its outcome could not be stored")
	errHijack         = errors.New("idempotency: Hijack is not supported by a guarded handler")
	errClientGone     = errors.New("idempotency: the client went away")
)

// statusClientClosedRequest answers a request whose client went away before
// its answer, as nginx logs one: no client reads it, but access logs and
// metrics then tell it from a store outage.
const statusClientClosedRequest = 499

type guarded struct {
	g              *Guard
	o              MiddlewareOptions
	next           http.Handler
	retryAfterSecs string // o.RetryAfter, as Retry-After sends it
	singleTenant   bool   // o.Scope is SingleTenant: the empty scope is every request's
}

func (h *guarded) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !slices.Contains(h.o.Methods, r.Method) {
		h.next.ServeHTTP(w, r)
		return
	}
	values := r.Header.Values(HeaderKey)
	if len(values) == 0 && h.o.OptionalKey {
		h.next.ServeHTTP(w, r)
		return
	}
	cs := h.g.newCall(r.Method, r.Pattern)
	k, body, err := h.admit(r, values)
	if err != nil {
		cs.decided = OutcomeRejected
		if errors.Is(err, ErrInvalidKey) || errors.Is(err, errKeyMissing) || errors.Is(err, errKeyRepeated) {
			cs.decided = OutcomeInvalidKey
		}
		h.g.report(r.Context(), k.Scope, &cs, Result{}, err)
		h.fail(w, r, err)
		return
	}
	if h.o.KeyTime != nil {
		if made, ok := h.o.KeyTime(r, k.Name); ok {
			cs.keyMade = made
		}
	}
	x := &exchange{h: h, w: w, r: r, body: body, fp: requestFingerprint(r, body, h.o.FingerprintHeaders)}
	cs.others = x
	x.serve(&cs, k, x.fp)
}

// admit checks everything that can be checked before the store is asked:
// the key, the scope and the body, which it returns buffered.
func (h *guarded) admit(r *http.Request, values []string) (Key, []byte, error) {
	switch len(values) {
	case 0:
		return Key{}, nil, errKeyMissing
	case 1:
	default:
		return Key{}, nil, errKeyRepeated
	}
	name, err := keyName(values[0])
	if err != nil {
		return Key{}, nil, err
	}
	k := Key{Name: name}
	if k.Scope, err = h.o.Scope(r); err != nil || k.Scope == "" && !h.singleTenant {
		return Key{}, nil, errScope
	}
	body, err := h.readBody(r)
	return k, body, err
}

// keyName is the key an Idempotency-Key field value names, or an error
// matching ErrInvalidKey: the one rule for a key, on both sides of a
// request.
func keyName(v string) (string, error) {
	name, err := parseKey(v)
	if err != nil {
		return "", err
	}
	return name, Key{Name: name}.Validate()
}

// parseKey reads an Idempotency-Key field value: an RFC 8941 sf-string with
// nothing after it, or, for clients that do not quote, the bare key.
func parseKey(v string) (string, error) {
	v = strings.Trim(v, " \t")
	if !strings.HasPrefix(v, `"`) {
		return v, nil
	}
	malformed := fmt.Errorf("%w: malformed structured-field string", ErrInvalidKey)
	var b strings.Builder
	for i := 1; i < len(v); i++ {
		switch c := v[i]; {
		case c == '\\':
			i++
			if i == len(v) || (v[i] != '"' && v[i] != '\\') {
				return "", malformed
			}
			b.WriteByte(v[i])
		case c == '"':
			if i != len(v)-1 {
				return "", malformed
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", malformed
		default:
			b.WriteByte(c)
		}
	}
	return "", malformed
}

// readBody reads the whole request body, refusing one over MaxRequestBytes
// without holding more than one byte past the limit.
func (h *guarded) readBody(r *http.Request) ([]byte, error) {
	limit := h.o.MaxRequestBytes
	if r.ContentLength > limit {
		return nil, bodyTooLargeError{limit}
	}
	if r.Body == nil {
		return nil, nil
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	var outer *http.MaxBytesError
	switch {
	case errors.As(err, &outer): // an outer http.MaxBytesReader
		return nil, bodyTooLargeError{outer.Limit}
	case err != nil:
		return nil, errBodyUnreadable
	case int64(len(body)) > limit:
		return nil, bodyTooLargeError{limit}
	}
	return body, nil
}

// bodyTooLargeError reports a request body over limit bytes.
type bodyTooLargeError struct{ limit int64 }

func (e bodyTooLargeError) Error() string {
	return fmt.Sprintf("idempotency: request body over %d bytes", e.limit)
}

// withBody returns a shallow copy of r with ctx and the buffered body.
func withBody(ctx context.Context, r *http.Request, body []byte) *http.Request {
	r = r.WithContext(ctx)
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	return r
}

// exchange is one guarded request: its run through the Guard, with the
// handler as the operation. Only the request's goroutine touches it.
type exchange struct {
	h    *guarded
	w    http.ResponseWriter
	r    *http.Request
	body []byte      // the request body, read whole
	fp   Fingerprint // the request's, under the middleware's rules
	rec  *recorder   // set once the handler runs: the request became the owner
	info *Info       // the handler's, set with rec
}

// otherFingerprints are the request's fingerprints under the rules of other
// instances and releases (see Guard.rematch).
func (x *exchange) otherFingerprints() []Fingerprint {
	return otherFingerprints(x.r, x.body, x.fp, x.h.o.FingerprintHeaders, x.h.o.OtherFingerprintHeaders)
}

// serve runs the handler as the Guard's operation, on the request's
// goroutine, so that a panic keeps its stack. The handler writes to a
// recorder, and the response is sent only once the Guard has stored it; a
// body too large to buffer is settled early instead (settleEarly), from
// inside the handler's Write, and then streamed.
func (x *exchange) serve(cs *callState, k Key, fp Fingerprint) {
	if x.h.o.FailOpen {
		cs.failOpen = func() { x.h.next.ServeHTTP(x.w, withBody(x.r.Context(), x.r, x.body)) }
	}
	res, err := x.h.g.call(x.r.Context(), k, fp, x.operate, cs)
	switch {
	case cs.decided == OutcomeFailedOpen:
		// The handler answered, unguarded.
	case x.rec == nil && err == nil:
		sendHead(x.w, res.Response.Status, res.Response.Header, true)
		_, _ = x.w.Write(res.Response.Body)
	case x.rec == nil && x.r.Context().Err() != nil:
		// The client has gone: nobody reads the answer, and the error is
		// its own doing, not the store's.
		x.h.fail(x.w, x.r, errClientGone)
	case x.rec == nil:
		x.h.fail(x.w, x.r, err)
	case x.rec.state != recording:
		// Settled early and streamed, or answered with a problem already.
	case err != nil:
		x.h.fail(x.w, x.r, err)
	case x.info.completedOutside():
		// The handler stored its outcome in its own transaction: the
		// client gets exactly that, whatever the handler wrote.
		sendHead(x.w, res.Response.Status, res.Response.Header, false)
		_, _ = x.w.Write(res.Response.Body)
	default:
		x.rec.send()
	}
}

// operate is the Guard's operation: the handler, writing to a recorder. Its
// status chooses the record's disposition, unless the handler chose.
func (x *exchange) operate(ctx context.Context) (Response, error) {
	x.info, _ = FromContext(ctx)
	x.rec = &recorder{w: x.w, header: make(http.Header), limit: x.h.o.MaxResponseBytes, settle: x.settleEarly}
	x.h.next.ServeHTTP(x.rec, withBody(ctx, x.r, x.body))
	resp, err := x.rec.outcome()
	if err == nil {
		x.info.defaultTo(x.h.o.Disposition(resp.Status))
	}
	if err == nil && x.rec.state == recording {
		resp = x.kept(resp)
	}
	return resp, err
}

// kept is what the record keeps of resp, a response the handler wrote
// (MiddlewareOptions.Stored), marked with what it omits. A mark already
// there ("too-large") stays.
func (x *exchange) kept(resp Response) Response {
	if x.h.o.Stored == nil {
		return resp
	}
	resp.Header, resp.Body = resp.Header.Clone(), bytes.Clone(resp.Body)
	kept, omitted := x.h.o.Stored(x.r, resp)
	if kept.Header == nil {
		kept.Header = http.Header{}
	}
	if omitted != "" && kept.Header.Get(HeaderBodyOmitted) == "" {
		kept.Header.Del("Content-Length")
		kept.Header.Set(HeaderBodyOmitted, omitted)
	}
	return kept
}

// OmitBody is a MiddlewareOptions.Stored that keeps a response's status
// and header fields but not its body, which replays omit ("omitted").
func OmitBody(_ *http.Request, resp Response) (Response, string) {
	resp.Body = nil
	return resp, "omitted"
}

// settleEarly settles the record with resp, the head of a response too large
// to buffer, while the handler still writes it. A failure is answered to the
// client at once, as a problem.
func (x *exchange) settleEarly(resp Response) error {
	x.info.defaultTo(x.h.o.Disposition(resp.Status))
	resp = x.kept(resp)
	err := x.info.settleEarly(resp)
	if err != nil {
		x.h.fail(x.w, x.r, err)
	}
	return err
}

// recorder is the handler's ResponseWriter. It buffers the response until
// its outcome is settled, so that no byte reaches the client before; past
// limit it settles early and then passes the rest through.
type recorder struct {
	w      http.ResponseWriter
	header http.Header // what the handler sets
	head   http.Header // header at WriteHeader: later changes are not sent, as with net/http
	status int
	body   []byte
	limit  int64
	state  recorderState
	settle func(Response) error // stores the outcome, or answers the client with a problem
}

type recorderState int

const (
	recording  recorderState = iota
	passing                  // the outcome is settled; writes go to the client
	discarding               // storing failed; the client got a problem
)

func (rec *recorder) Header() http.Header {
	if rec.state == passing {
		return rec.w.Header()
	}
	return rec.header
}

func (rec *recorder) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code)) // as net/http does
	}
	switch {
	case rec.state == passing:
		rec.w.WriteHeader(code)
	case rec.state == discarding, rec.status != 0:
	case code < 200:
		// An informational response would reach the client before the
		// outcome is stored: it is dropped.
	default:
		rec.status = code
		rec.head = rec.header.Clone()
	}
}

func (rec *recorder) Write(p []byte) (int, error) {
	switch rec.state {
	case passing:
		return rec.w.Write(p)
	case discarding:
		return 0, errNotStored
	}
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	if rec.status == http.StatusNoContent || rec.status == http.StatusNotModified {
		return 0, http.ErrBodyNotAllowed
	}
	if int64(len(rec.body))+int64(len(p)) <= rec.limit {
		rec.body = append(rec.body, p...)
		return len(p), nil
	}
	return rec.overflow(p)
}

// overflow settles a response whose body outgrew the limit with its status
// and header fields only, then sends it whole, streaming what follows.
func (rec *recorder) overflow(p []byte) (int, error) {
	setContentType(rec.head, rec.body, p)
	stored := storedHeader(rec.head)
	stored.Del("Content-Length")
	stored.Set(HeaderBodyOmitted, "too-large")
	if err := rec.settle(Response{Status: rec.status, Header: stored}); err != nil {
		rec.state, rec.body = discarding, nil
		return 0, errNotStored
	}
	rec.state = passing
	sendHead(rec.w, rec.status, rec.head, false)
	copyTrailers(rec.w.Header(), rec.header)
	buffered := rec.body
	rec.body = nil
	if _, err := rec.w.Write(buffered); err != nil {
		return 0, err
	}
	return rec.w.Write(p)
}

// outcome is the response of a handler that returned, to be stored before
// send sends it.
func (rec *recorder) outcome() (Response, error) {
	switch rec.state {
	case passing:
		return Response{}, nil // settled already, before it streamed
	case discarding:
		return Response{}, errNotStored
	}
	if rec.status == 0 {
		rec.WriteHeader(http.StatusOK)
	}
	setContentType(rec.head, rec.body, nil)
	return Response{Status: rec.status, Header: storedHeader(rec.head), Body: rec.body}, nil
}

// send sends the response once its outcome is stored.
func (rec *recorder) send() {
	sendHead(rec.w, rec.status, rec.head, false)
	_, _ = rec.w.Write(rec.body)
	copyTrailers(rec.w.Header(), rec.header)
}

// Flush does nothing until the outcome is stored: flushing earlier would
// send bytes whose outcome could still be lost.
func (rec *recorder) Flush() {
	if rec.state == passing {
		_ = http.NewResponseController(rec.w).Flush()
	}
}

// Hijack fails: a hijacked connection's bytes could be neither stored nor
// replayed.
func (rec *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errHijack
}

// Unwrap lets http.ResponseController reach the connection's deadlines.
func (rec *recorder) Unwrap() http.ResponseWriter { return rec.w }

// setContentType does what net/http would do when the first bytes are
// written without a Content-Type, so that the stored header fields are the
// ones the client saw.
func setContentType(h http.Header, body, more []byte) {
	if _, ok := h["Content-Type"]; ok || h.Get("Transfer-Encoding") != "" || len(body)+len(more) == 0 {
		return
	}
	const sniffLen = 512 // what http.DetectContentType considers
	if len(body) < sniffLen {
		body = append(body[:len(body):len(body)], more[:min(len(more), sniffLen-len(body))]...)
	}
	h.Set("Content-Type", http.DetectContentType(body))
}

// storedHeader returns the header fields of h that may be replayed: not
// those meant for one client (Set-Cookie), one connection (hop-by-hop
// fields and those Connection names) or one moment (Date). The values are
// h's own: h is the recorder's copy taken at WriteHeader, which the
// handler no longer reaches, and a store keeps its own copy of what it
// stores.
func storedHeader(h http.Header) http.Header {
	connection := h.Values("Connection")
	out := make(http.Header, len(h))
	for name, vs := range h {
		if !notStored(http.CanonicalHeaderKey(name), connection) {
			out[name] = vs
		}
	}
	return out
}

func notStored(name string, connection []string) bool {
	switch name {
	case "Set-Cookie", "Date", HeaderReplayed, "Connection", "Keep-Alive", "Proxy-Authenticate",
		"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	if strings.HasPrefix(name, http.TrailerPrefix) {
		return true
	}
	for _, v := range connection {
		for option := range strings.SplitSeq(v, ",") {
			if strings.EqualFold(strings.TrimSpace(option), name) {
				return true
			}
		}
	}
	return false
}

// copyTrailers hands the trailers the handler set after its header was sent
// to net/http, which sends them after the body.
func copyTrailers(dst, src http.Header) {
	for name, vs := range src {
		if strings.HasPrefix(name, http.TrailerPrefix) {
			dst[name] = vs
		}
	}
	for _, v := range src.Values("Trailer") {
		for name := range strings.SplitSeq(v, ",") {
			name = http.CanonicalHeaderKey(strings.TrimSpace(name))
			if vs, ok := src[name]; ok {
				dst[name] = vs
			}
		}
	}
}

// sendHead writes a response's status and header fields to w. They replace
// fields of the same name that outer middleware may have set. The values
// are handed over, not copied: h is this request's own (a replay's, read
// from the store for it, or the recorder's, copied at WriteHeader), and
// nothing reads it once sent.
func sendHead(w http.ResponseWriter, status int, h http.Header, replayed bool) {
	dst := w.Header()
	for name, vs := range h {
		dst[name] = vs
	}
	if replayed {
		dst.Set(HeaderReplayed, "true")
	}
	w.WriteHeader(status)
}
