// Package idempotencygin makes a retried gin request run its handlers at
// most once per idempotency key, across every instance that shares the
// idempotency.Guard's store, and answers every retry with the same response.
//
// Middleware bridges gin to the library's own net/http middleware,
// idempotency.Guard.Middleware, so the contract is that middleware's, word
// for word: see docs/http.md.
//
//	r := gin.New()
//	r.ContextWithFallback = true
//	r.Use(gin.Recovery())
//	r.POST("/v1/charges", idempotencygin.Middleware(guard, idempotency.MiddlewareOptions{
//		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
//	}), createCharge)
//
// The engine must set ContextWithFallback, so that a handler can pass c
// itself as the attempt's context.Context: idempotency.FromContext,
// DownstreamKey, Step, SetDisposition and postgres.Store.CompleteTx take
// c as they take c.Request.Context(), and c.Done() ends with the attempt.
// Without it a gin.Context carries none of the request's values and is
// never done, so Middleware refuses every guarded request with a 500 (see
// ErrContextWithoutFallback) rather than let such a handler run without its
// operation.
package idempotencygin

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/idempotency-go/idempotency"
)

// Middleware returns gin middleware that runs the handlers after it through
// g.Middleware(o), so that they run at most once per key (o.Scope, the
// Idempotency-Key header) and every retry gets the same response: the
// stored status, header fields and body, byte for byte, with
// Idempotent-Replayed: true. Its answers are those of Guard.Middleware:
// 422 for a key reused with another request, a duplicate that waits for
// its original, o.Errors for every refusal, a 5xx or a panic that releases
// the key, a body over o.MaxResponseBytes stored without it.
//
// While the handlers after it run, c.Request is the guarded request: its
// context carries the attempt, and so does c, and its body is the buffered
// body. c.Writer is a gin.ResponseWriter over the middleware's buffer, and
// nothing reaches the client before the outcome is stored. A status set
// without a body (c.Status, c.AbortWithStatus) is the response's status,
// as gin would send it. Flush sends nothing until the outcome is stored,
// Hijack fails, Pusher is nil and CloseNotify never fires. When they
// return, or panic, c.Request and c.Writer are the ones Middleware found
// again, so that middleware before it, gin.Recovery among them, writes to
// the client. A panic releases the key, whether or not the handler had
// begun its body: a gin.Recovery after Middleware answers 500 inside it,
// or, once the body began, lets gin send that, and either way the key is
// released.
//
// Handlers that record an error (c.Error) and write nothing have their key
// released, and Middleware sends nothing: the status and header fields they
// set are c.Writer's once it returns, unwritten, so that middleware before
// it that renders c.Errors (the usual layout) answers the client, as it
// would without Middleware. Nothing is stored, and a retry runs the
// handlers again. Handlers that write a response and record an error are
// answered with what they wrote, which decides the record as any response
// does; middleware that renders c.Errors finds it sent.
//
// A request whose handlers do not run (a replay, or an answer of the
// middleware's own: 422, 409, 503, ...) is answered, and c.Abort stops the
// chain. So is a guarded request on an engine whose ContextWithFallback is
// false: a 500 problem through o.Errors (code context-without-fallback,
// the record forgotten), with ErrContextWithoutFallback in c.Errors.
// Requests of a method not in o.Methods, and without a key when
// o.OptionalKey is set, go on to the next handler untouched.
//
// Mounted with the engine's Use, it runs for a request that matches no
// route too: gin's 404 is then the answer, kept and replayed without gin's
// default body.
//
// The route's pattern, c.FullPath(), becomes the request's Pattern when it
// has none, as ServeMux and chi set it, and so the Route of the Guard's
// events. Middleware panics when o.Scope is nil.
func Middleware(g *idempotency.Guard, o idempotency.MiddlewareOptions) gin.HandlerFunc {
	guard := g.Middleware(o)
	refuse := o.Errors
	if refuse == nil {
		refuse = idempotency.ProblemDetails
	}
	return func(c *gin.Context) {
		req, w := c.Request, c.Writer
		defer func() { c.Request, c.Writer = req, w }()
		if req.Pattern == "" {
			req.Pattern = c.FullPath()
		}
		out := &client{ResponseWriter: w}
		ran := false
		guard(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			ran = true
			c.Request = r
			if rw == http.ResponseWriter(out) { // passed through, or run unguarded
				c.Writer = w
				c.Next()
				return
			}
			if _, ok := idempotency.FromContext(c); !ok {
				noFallback(c, rw, r, refuse)
				return
			}
			run(c, rw, r, w.Status(), out)
		})).ServeHTTP(out, req)
		if !ran {
			c.Abort()
		}
	}
}

// ErrContextWithoutFallback is recorded in c.Errors of a guarded request
// that Middleware refused because the engine's ContextWithFallback is
// false: a handler that passed c as its context.Context would find no
// operation in it (DownstreamKey fails, SetDisposition does nothing) and
// c.Done() would never fire.
var ErrContextWithoutFallback = errors.New("idempotencygin: the gin engine's ContextWithFallback is false: " +
	"set engine.ContextWithFallback = true, so that a handler's *gin.Context carries the idempotent attempt")

// codeContextWithoutFallback is the Problem.Code of the refusal of a
// guarded request on an engine without ContextWithFallback.
const codeContextWithoutFallback = "context-without-fallback"

// noFallback answers a guarded request on an engine without
// ContextWithFallback: none of c's handlers runs, the record is forgotten,
// and the client gets a 500 problem, written as o.Errors writes them.
func noFallback(c *gin.Context, rw http.ResponseWriter, r *http.Request, refuse func(http.ResponseWriter, *http.Request, idempotency.Problem)) {
	c.Abort()
	_ = c.Error(ErrContextWithoutFallback)
	idempotency.SetDisposition(r.Context(), idempotency.Forget)
	rw.Header().Set("Cache-Control", "no-store")
	refuse(rw, r, idempotency.Problem{
		Type:   idempotency.ProblemTypes + codeContextWithoutFallback,
		Title:  "Server misconfigured",
		Status: http.StatusInternalServerError,
		Detail: "The server's gin engine does not set ContextWithFallback, which idempotent requests need; the request was not run.",
		Code:   codeContextWithoutFallback,
	})
}

// run runs the rest of c's handlers on r, writing to rw, the middleware's
// buffer. The buffer starts with gin's status, the 404 of a request that
// matched no route among others. Once the handlers return, a status they
// only set is written, as gin's engine does after its handlers, unless
// they recorded an error and wrote nothing: then the key is released, and
// out, the client, takes their status and header fields, unwritten, and
// none of what the middleware sends, so that middleware before Middleware
// renders the error.
func run(c *gin.Context, rw http.ResponseWriter, r *http.Request, status int, out *client) {
	buf := &writer{ResponseWriter: rw, ctx: r.Context(), status: status, size: unwritten}
	c.Writer = buf
	errs := len(c.Errors)
	c.Next()
	if buf.Written() || len(c.Errors) == errs {
		buf.WriteHeaderNow()
		return
	}
	idempotency.SetDisposition(r.Context(), idempotency.Release)
	out.mute(buf.status, buf.Header())
}

// client is the writer the middleware answers on: gin's, until mute.
type client struct {
	http.ResponseWriter // gin's
	muted               bool
	discarded           http.Header // what the middleware sets once muted
}

// mute hands status and header, those of handlers that recorded an error
// and wrote nothing, to gin's writer without writing them, and discards
// what the middleware sends after: the answer is the error renderer's.
func (w *client) mute(status int, header http.Header) {
	dst := w.ResponseWriter.Header()
	for name, vs := range header {
		dst[name] = vs
	}
	w.ResponseWriter.WriteHeader(status) // gin's writer holds it until written
	w.muted, w.discarded = true, make(http.Header)
}

func (w *client) Header() http.Header {
	if w.muted {
		return w.discarded
	}
	return w.ResponseWriter.Header()
}

func (w *client) WriteHeader(code int) {
	if !w.muted {
		w.ResponseWriter.WriteHeader(code)
	}
}

func (w *client) Write(p []byte) (int, error) {
	if w.muted {
		return len(p), nil
	}
	return w.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach gin's writer: the middleware
// flushes a response it streams, and sets the connection's deadlines.
func (w *client) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// unwritten is writer.size until the status is written.
const unwritten = -1

// writer is c.Writer while guarded handlers run: gin's ResponseWriter
// semantics over the middleware's buffer. As gin's own, it holds the status
// until the first write or WriteHeaderNow, and ignores a status set after.
type writer struct {
	http.ResponseWriter                 // the middleware's buffer
	ctx                 context.Context // the attempt's
	status              int
	size                int // bytes written, or unwritten
}

// WriteHeader sets the status until it is written. A 5xx set after, as
// gin.Recovery sets it when a handler panicked part-way through its body,
// cannot be sent, but the handler failed: the key is released, and the
// partial response is never replayed.
func (w *writer) WriteHeader(code int) {
	switch {
	case code <= 0:
	case !w.Written():
		w.status = code
	case code >= http.StatusInternalServerError:
		idempotency.SetDisposition(w.ctx, idempotency.Release)
	}
}

func (w *writer) WriteHeaderNow() {
	if !w.Written() {
		w.size = 0
		w.ResponseWriter.WriteHeader(w.status)
	}
}

func (w *writer) Write(p []byte) (int, error) {
	w.WriteHeaderNow()
	n, err := w.ResponseWriter.Write(p)
	w.size += n
	return n, err
}

func (w *writer) WriteString(s string) (int, error) {
	w.WriteHeaderNow()
	n, err := io.WriteString(w.ResponseWriter, s)
	w.size += n
	return n, err
}

func (w *writer) Status() int   { return w.status }
func (w *writer) Size() int     { return w.size }
func (w *writer) Written() bool { return w.size != unwritten }

// Flush writes the status, then flushes what the middleware lets through:
// nothing before the outcome is stored.
func (w *writer) Flush() {
	w.WriteHeaderNow()
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack fails, as the middleware's: a hijacked connection's bytes could be
// neither stored nor replayed.
func (w *writer) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return http.NewResponseController(w.ResponseWriter).Hijack()
}

// CloseNotify returns a channel that never fires: a guarded handler runs to
// its end whether or not the client stays (see Options.CancelWithCaller),
// and c.Request.Context() says when it must stop.
func (w *writer) CloseNotify() <-chan bool { return nil }

// Pusher is nil: a pushed response would reach the client before the
// outcome is stored.
func (w *writer) Pusher() http.Pusher { return nil }

// Unwrap lets http.ResponseController reach the middleware's buffer, and
// through it the connection's deadlines.
func (w *writer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
