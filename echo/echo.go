// Package idempotencyecho makes a retried echo request run its handler at
// most once per idempotency key, across every instance that shares the
// idempotency.Guard's store, and answers every retry with the same response.
//
// Middleware bridges echo to the library's own net/http middleware,
// idempotency.Guard.Middleware, so the contract is that middleware's, word
// for word: see docs/http.md. Unlike echo.WrapMiddleware around it, the
// adapter has echo answer a handler's returned error inside the middleware,
// so that echo's answer is the one stored (or released) and sent, not an
// empty 200.
//
//	e := echo.New()
//	e.Use(middleware.Recover())
//	e.POST("/v1/charges", createCharge, idempotencyecho.Middleware(guard, idempotency.MiddlewareOptions{
//		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
//	}))
//
// A handler reads the attempt from c.Request().Context():
// idempotency.FromContext, DownstreamKey, Step, SetDisposition and
// postgres.Store.CompleteTx all take it.
package idempotencyecho

import (
	"context"
	"net/http"
	"reflect"

	"github.com/labstack/echo/v4"

	"github.com/idempotency-go/idempotency"
)

// Middleware returns echo middleware that runs the rest of echo's chain,
// the handler and the middleware after it, through g.Middleware(o), so
// that it runs at most once per key (o.Scope, the Idempotency-Key header)
// and every retry gets the same response: the stored status, header fields
// and body, byte for byte, with Idempotent-Replayed: true. Its answers are
// those of Guard.Middleware: 422 for a key reused with another request, a
// duplicate that waits for its original, o.Errors for every refusal, a 5xx
// or a panic that releases the key, a body over o.MaxResponseBytes stored
// without it.
//
// While the chain after it runs, c.Request() is the guarded request: its
// context carries the attempt, and its body is the buffered body, which
// c.Bind reads. c.Response() is an echo.Response over the middleware's
// buffer: nothing reaches the client before the outcome is stored, and
// its Committed, Status and Size say what the handler wrote there (so
// Committed turns true at its first write). It starts with the status of
// the response Middleware found, 200 unless middleware before it set one.
// Flush sends nothing until the outcome is stored, and Hijack fails.
//
// An error the chain returns is answered there, with c.Error (echo's
// HTTPErrorHandler), so that echo's answer decides the record as a
// handler's own would: the status of an echo.HTTPError, or, for any other
// error, 500, which releases the key.
// The error is not returned: middleware before Middleware finds the
// answer sent, and nil. An error returned once the handler had begun its
// response, which echo's error handler leaves as it is, releases the key:
// the client gets what was written, and no retry gets it replayed.
//
// A panic releases the key, whether or not the handler had begun its
// response. It goes on, once c.Request() and c.Response() are the ones
// Middleware found again, to a middleware.Recover before it, which answers
// 500 to the client, or to net/http. A Recover after Middleware answers it
// inside with c.Error: echo's 500, or, once the handler had begun its
// response, which echo's error handler leaves as it is, what the handler
// wrote; the key is released either way, and nothing is replayed. So is
// it for any error handed to c.Error once the response began.
//
// To see those errors, the chain after Middleware gets an echo.Context
// that wraps echo's own. A Context of the application's own type, which
// middleware before Middleware made, is handed on as it is, so that
// handlers' type assertions to it hold; Middleware then cannot see an
// error handed to c.Error after the response began, and a Recover must go
// before it for a panic after the response began to release the key.
//
// Once the chain after it returns, and before the answer is sent,
// c.Request() and c.Response() are the ones Middleware found again. That
// response then has the Committed, Status and Size of what the client was
// sent: the handler's stored answer, a replay, or an answer of the
// middleware's own (422, 409, 503, ...), for which the chain after it does
// not run. Functions registered on it with Before and After run as that
// answer is sent; those registered after Middleware, as the handler writes
// to the buffer.
//
// Requests of a method not in o.Methods, and without a key when
// o.OptionalKey is set, go on through the chain untouched, with the
// request and response Middleware found, and their errors are returned to
// echo. So are those that o.FailOpen runs unguarded when the store cannot
// be reached, but with the buffered body.
//
// Mounted with e.Use, it runs after routing, for requests that match no
// route too: echo's 404 (or 405, for a path whose routes take other
// methods) is then answered inside it, kept and replayed, and the key is
// spent. On a group, the same holds for every path under the group's
// prefix, which echo routes to a 404 of the group's own (its route is the
// prefix followed by /*). On a route, only that route is guarded.
//
// The route's path, c.Path(), becomes the request's Pattern when it has
// none, and so the Route of the Guard's events. Middleware panics when
// o.Scope is nil.
func Middleware(g *idempotency.Guard, o idempotency.MiddlewareOptions) echo.MiddlewareFunc {
	guard := g.Middleware(o)
	own := reflect.TypeOf(echo.New().NewContext(nil, nil)) // echo's own Context type
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) (err error) {
			req, res := c.Request(), c.Response()
			if req.Pattern == "" {
				req.Pattern = c.Path()
			}
			guard(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				// Put back before the middleware sends the answer, or
				// before a panic goes on.
				defer func() { c.SetRequest(req); c.SetResponse(res) }()
				c.SetRequest(r)
				if w == http.ResponseWriter(res) { // passed through, or run unguarded
					err = next(c)
					return
				}
				answer(c, w, r, res.Status, next, reflect.TypeOf(c) == own)
			})).ServeHTTP(res, req)
			return err
		}
	}
}

// answer runs next on w, the middleware's buffer, through a response of
// its own that starts with status, and answers its error there with echo's
// error handler, as echo would once the chain returned. When watch is set,
// c is echo's own Context, and next gets it wrapped, so that an error
// handed to c.Error after the response began releases the key too.
func answer(c echo.Context, w http.ResponseWriter, r *http.Request, status int, next echo.HandlerFunc, watch bool) {
	res := echo.NewResponse(w, c.Echo())
	res.Status = status
	c.SetResponse(res)
	chain := c
	if watch {
		chain = &watched{Context: c, ctx: r.Context()}
	}
	err := next(chain)
	if err == nil {
		return
	}
	if res.Committed {
		// echo's error handler leaves a begun response as it is: the
		// handler failed part-way, and its answer must not be replayed.
		idempotency.SetDisposition(r.Context(), idempotency.Release)
	}
	c.Error(err)
}

// watched is echo's own Context while the chain after Middleware runs. An
// error handed to its Error once the response began, which echo's error
// handler leaves as it is (a middleware.Recover after Middleware answering
// a panic, say), releases the key: the handler failed part-way, and its
// answer must not be replayed.
type watched struct {
	echo.Context
	ctx context.Context // the attempt's
}

func (c *watched) Error(err error) {
	if c.Response().Committed {
		idempotency.SetDisposition(c.ctx, idempotency.Release)
	}
	c.Context.Error(err)
}
