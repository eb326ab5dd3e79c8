// Package idempotencygin makes a retried gin request run its handlers at
// most once per idempotency key, across every instance that shares the
// idempotency.Guard's store, and answers every retry with the same response.
//
// Middleware bridges gin to the library's own net/http middleware,
// idempotency.Guard.Middleware, so the contract is that middleware's, word
// for word: see docs/http.md.
//
//	r := gin.New()
//	r.Use(gin.Recovery())
//	r.POST("/v1/charges", idempotencygin.Middleware(guard, idempotency.MiddlewareOptions{
//		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
//	}), createCharge)
//
// A handler reads the attempt from c.Request.Context(), not from c:
// idempotency.FromContext, DownstreamKey, Step, SetDisposition and
// postgres.Store.CompleteTx all take it. (A gin.Context finds the request's
// values only when the engine's ContextWithFallback is set.)
package idempotencygin

import (
	"bufio"
	"context"
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
// context carries the attempt, and its body is the buffered body. c.Writer
// is a gin.ResponseWriter over the middleware's buffer, and nothing reaches
// the client before the outcome is stored. A status set without a body
// (c.Status, c.AbortWithStatus) is the response's status, as gin would send
// it. Flush sends nothing until the outcome is stored, Hijack fails,
// Pusher is nil and CloseNotify never fires. When they return, or panic,
// c.Request and c.Writer are the ones Middleware found again, so that
// middleware before it, gin.Recovery among them, writes to the client. A
// gin.Recovery after Middleware answers a panic with 500 inside it, which
// releases the key too, and so does a 5xx it sets once the handler has
// begun its body, though gin then sends that body.
//
// A request whose handlers do not run (a replay, or an answer of the
// middleware's own: 422, 409, 503, ...) is answered, and c.Abort stops the
// chain. Requests of a method not in o.Methods, and without a key when
// o.OptionalKey is set, go on to the next handler untouched. Middleware
// that renders c.Errors into a response must come after Middleware, for
// its answer to be the one stored: before it, it finds the response sent.
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
	return func(c *gin.Context) {
		req, w := c.Request, c.Writer
		defer func() { c.Request, c.Writer = req, w }()
		if req.Pattern == "" {
			req.Pattern = c.FullPath()
		}
		ran := false
		guard(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
			ran = true
			next(c, rw, r, w.Status())
		})).ServeHTTP(w, req)
		if !ran {
			c.Abort()
		}
	}
}

// next runs the rest of c's handlers on r, writing to rw: the middleware's
// buffer for a guarded request, or gin's own writer for one passed through.
// The buffer starts with gin's status, the 404 of a request that matched
// no route among others. Once the handlers return, a status they only set
// is written, as gin's engine does after its handlers.
func next(c *gin.Context, rw http.ResponseWriter, r *http.Request, status int) {
	c.Request = r
	if gw, ok := rw.(gin.ResponseWriter); ok {
		c.Writer = gw
		c.Next()
		return
	}
	buf := &writer{ResponseWriter: rw, ctx: r.Context(), status: status, size: unwritten}
	c.Writer = buf
	c.Next()
	buf.WriteHeaderNow()
}

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
