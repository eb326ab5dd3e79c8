package idempotencyecho_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	idempotencyecho "github.com/idempotency-go/idempotency/echo"
)

func newGuard() *idempotency.Guard {
	return idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
}

// newEcho is an echo server that logs nothing.
func newEcho() *echo.Echo {
	e := echo.New()
	e.Logger.SetOutput(io.Discard)
	return e
}

// recoverQuietly is middleware.Recover without the stack it prints.
var recoverQuietly = middleware.RecoverWithConfig(middleware.RecoverConfig{DisablePrintStack: true})

// charges is an echo server whose POST /v1/charges runs handler behind the
// adapter, then the middleware after it.
func charges(g *idempotency.Guard, o idempotency.MiddlewareOptions, handler echo.HandlerFunc, after ...echo.MiddlewareFunc) *echo.Echo {
	e := newEcho()
	e.POST("/v1/charges", handler, append([]echo.MiddlewareFunc{idempotencyecho.Middleware(g, o)}, after...)...)
	return e
}

var singleTenant = idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}

// post sends a JSON POST /v1/charges with the key, if any, to h.
func post(h http.Handler, key, body string) *httptest.ResponseRecorder {
	return send(h, http.MethodPost, "/v1/charges", key, body)
}

// send sends a JSON request with the key, if any, to h.
func send(h http.Handler, method, path, key, body string) *httptest.ResponseRecorder {
	req := httptest.NewRequest(method, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, req)
	return rr
}

// createCharge binds the body and answers c.JSON 201, counting its runs.
func createCharge(runs *atomic.Int64) echo.HandlerFunc {
	return func(c echo.Context) error {
		var in struct{ Amount int }
		if err := c.Bind(&in); err != nil {
			return err
		}
		run := runs.Add(1)
		c.Response().Header().Set("X-Charge", fmt.Sprint("ch_", run))
		return c.JSON(http.StatusCreated, map[string]any{"id": fmt.Sprint("ch_", run), "amount": in.Amount})
	}
}

// TestReplayByteForByte: a retry gets the c.JSON answer of the one run,
// status, header fields and body, marked replayed; the handler does not
// run again, and middleware before the adapter sees the status sent.
func TestReplayByteForByte(t *testing.T) {
	var runs atomic.Int64
	var statuses []int
	e := newEcho()
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			err := next(c)
			statuses = append(statuses, c.Response().Status)
			return err
		}
	})
	e.POST("/v1/charges", createCharge(&runs), idempotencyecho.Middleware(newGuard(), singleTenant))

	first := post(e, "k1", `{"amount":4200}`)
	require.Equal(t, http.StatusCreated, first.Code)
	assert.JSONEq(t, `{"id":"ch_1","amount":4200}`, first.Body.String())
	assert.Empty(t, first.Header().Get(idempotency.HeaderReplayed))

	again := post(e, "k1", `{ "amount": 4200 }`) // the same JSON, spelt otherwise
	assert.Equal(t, http.StatusCreated, again.Code)
	assert.Equal(t, first.Body.Bytes(), again.Body.Bytes())
	want := first.Header().Clone()
	want.Set(idempotency.HeaderReplayed, "true")
	assert.Equal(t, want, again.Header())
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, []int{http.StatusCreated, http.StatusCreated}, statuses)
}

// waitCounter is a store that counts the duplicates subscribing to wait for
// their original, and closes all once there are n.
type waitCounter struct {
	idempotency.Store
	n       int64
	waiting atomic.Int64
	all     chan struct{}
}

func (s *waitCounter) Subscribe(ctx context.Context, k idempotency.Key) (idempotency.Subscription, error) {
	if s.waiting.Add(1) == s.n {
		close(s.all)
	}
	return s.Store.Subscribe(ctx, k)
}

// TestDuplicatesWait: concurrent requests with one key run the handler
// once; every duplicate waits for it and gets its answer.
func TestDuplicatesWait(t *testing.T) {
	const n = 20
	store := &waitCounter{Store: idempotency.NewMemoryStore(idempotency.MemoryOptions{}), n: n - 1, all: make(chan struct{})}
	var runs atomic.Int64
	charge := createCharge(&runs)
	e := charges(idempotency.New(store, idempotency.Options{}), singleTenant, func(c echo.Context) error {
		select { // hold the original until every duplicate waits for it
		case <-store.all:
		case <-time.After(10 * time.Second):
		}
		return charge(c)
	})

	answers := make([]*httptest.ResponseRecorder, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { answers[i] = post(e, "same", `{"amount":100}`) })
	}
	wg.Wait()
	assert.Equal(t, int64(1), runs.Load(), "handler runs")
	replayed := 0
	for _, a := range answers {
		assert.Equal(t, http.StatusCreated, a.Code)
		assert.JSONEq(t, `{"id":"ch_1","amount":100}`, a.Body.String())
		if a.Header().Get(idempotency.HeaderReplayed) == "true" {
			replayed++
		}
	}
	assert.Equal(t, n-1, replayed)
}

// TestKeyReused: the key sent again with another body gets 422, and the
// handler does not run.
func TestKeyReused(t *testing.T) {
	var runs atomic.Int64
	e := charges(newGuard(), singleTenant, createCharge(&runs))
	require.Equal(t, http.StatusCreated, post(e, "k1", `{"amount":100}`).Code)

	rr := post(e, "k1", `{"amount":999}`)
	assert.Equal(t, http.StatusUnprocessableEntity, rr.Code)
	assert.Equal(t, "application/problem+json", rr.Header().Get("Content-Type"))
	assert.Contains(t, rr.Body.String(), `"code":"key-reused"`)
	assert.Equal(t, int64(1), runs.Load())
}

// TestStripeErrors: with the StripeErrors profile, a reused key answers
// as Stripe's API does, and a missing key too.
func TestStripeErrors(t *testing.T) {
	var runs atomic.Int64
	e := charges(newGuard(), idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, Errors: idempotency.StripeErrors}, createCharge(&runs))
	require.Equal(t, http.StatusCreated, post(e, "k1", `{"amount":100}`).Code)

	for key, code := range map[string]string{"k1": "key-reused", "": "missing-key"} {
		rr := post(e, key, `{"amount":999}`)
		assert.Equal(t, http.StatusBadRequest, rr.Code)
		assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
		assert.Equal(t, "false", rr.Header().Get("Stripe-Should-Retry"))
		var body struct{ Error map[string]string }
		require.NoError(t, json.Unmarshal(rr.Body.Bytes(), &body), rr.Body.String())
		assert.Equal(t, "idempotency_error", body.Error["type"])
		assert.Equal(t, code, body.Error["code"])
	}
	assert.Equal(t, int64(1), runs.Load())
}

// TestRefusedBeforeTheAdapter: a request that middleware before the
// adapter refuses claims nothing: the key stays free for the request that
// passes.
func TestRefusedBeforeTheAdapter(t *testing.T) {
	var runs atomic.Int64
	e := newEcho()
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			if c.Request().Header.Get("Authorization") == "" {
				return echo.NewHTTPError(http.StatusUnauthorized, "unauthenticated")
			}
			return next(c)
		}
	})
	e.POST("/v1/charges", createCharge(&runs), idempotencyecho.Middleware(newGuard(), singleTenant))

	rr := post(e, "k1", `{"amount":100}`)
	assert.Equal(t, http.StatusUnauthorized, rr.Code)
	assert.JSONEq(t, `{"message":"unauthenticated"}`, rr.Body.String())

	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":200}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer t")
	req.Header.Set(idempotency.HeaderKey, "k1")
	rr = httptest.NewRecorder()
	e.ServeHTTP(rr, req)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.JSONEq(t, `{"id":"ch_1","amount":200}`, rr.Body.String())
}

// TestHandlerErrors: an error the handler returns is answered inside the
// guard by echo's HTTPErrorHandler, so the client gets echo's usual
// answer and its status decides the record. A 5xx (a plain error is a
// 500) releases the key: the retry runs again as the same operation. A
// refusal the client can correct (409) forgets it: the retry runs as a
// new operation. Any other status (402) is kept and replayed as echo
// answered it. Middleware before the adapter finds the answer sent, and
// no error.
func TestHandlerErrors(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
		body   string
	}{
		{errors.New("gateway down"), http.StatusInternalServerError, `{"message":"Internal Server Error"}`},
		{echo.NewHTTPError(http.StatusServiceUnavailable, "gateway down"), http.StatusServiceUnavailable, `{"message":"gateway down"}`},
		{echo.NewHTTPError(http.StatusConflict, "busy"), http.StatusConflict, `{"message":"busy"}`},
		{echo.NewHTTPError(http.StatusPaymentRequired, "card declined"), http.StatusPaymentRequired, `{"message":"card declined"}`},
	} {
		t.Run(fmt.Sprint(c.status), func(t *testing.T) {
			var ops []string
			var outer []error
			e := newEcho()
			e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
				return func(ec echo.Context) error {
					err := next(ec)
					outer = append(outer, err)
					return err
				}
			})
			e.POST("/v1/charges", func(ec echo.Context) error {
				info, _ := idempotency.FromContext(ec.Request().Context())
				ops = append(ops, info.OperationID)
				if len(ops) == 1 {
					return c.err
				}
				return ec.JSON(http.StatusCreated, map[string]any{"attempt": info.Attempt})
			}, idempotencyecho.Middleware(newGuard(), singleTenant))

			rr := post(e, "k1", `{}`)
			assert.Equal(t, c.status, rr.Code)
			assert.JSONEq(t, c.body, rr.Body.String())
			assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
			assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))

			rr = post(e, "k1", `{}`)
			switch {
			case c.status >= 500:
				require.Len(t, ops, 2, "the retry ran the handler")
				assert.JSONEq(t, `{"attempt":2}`, rr.Body.String(), "released")
				assert.Equal(t, ops[0], ops[1])
			case c.status == http.StatusConflict:
				require.Len(t, ops, 2, "the retry ran the handler")
				assert.JSONEq(t, `{"attempt":1}`, rr.Body.String(), "forgotten")
				assert.NotEqual(t, ops[0], ops[1])
			default:
				assert.Len(t, ops, 1, "kept")
				assert.Equal(t, c.status, rr.Code)
				assert.JSONEq(t, c.body, rr.Body.String())
				assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
			}
			assert.Equal(t, []error{nil, nil}, outer, "the error was answered inside")
		})
	}
}

// TestErrorAfterTheResponseBegan: an error returned, or handed to c.Error,
// once the handler has begun its response is one echo's error handler
// leaves as it is: the client gets what was written, but the key is
// released, so that a retry runs the handler again rather than get a
// failed answer replayed.
func TestErrorAfterTheResponseBegan(t *testing.T) {
	for _, handed := range []bool{false, true} {
		t.Run(fmt.Sprintf("handed to c.Error %t", handed), func(t *testing.T) {
			var runs atomic.Int64
			e := charges(newGuard(), singleTenant, func(c echo.Context) error {
				if runs.Add(1) == 1 {
					_ = c.String(http.StatusOK, "partial")
					if handed {
						c.Error(errors.New("gateway down"))
						return nil
					}
					return errors.New("gateway down")
				}
				info, _ := idempotency.FromContext(c.Request().Context())
				return c.JSON(http.StatusCreated, map[string]any{"attempt": info.Attempt})
			})
			rr := post(e, "k1", `{}`)
			assert.Equal(t, http.StatusOK, rr.Code)
			assert.Equal(t, "partial", rr.Body.String())

			rr = post(e, "k1", `{}`)
			assert.Equal(t, http.StatusCreated, rr.Code)
			assert.JSONEq(t, `{"attempt":2}`, rr.Body.String())
			assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
			assert.Equal(t, int64(2), runs.Load())
		})
	}
}

// customContext is an application's own echo.Context, as echo's guide
// has middleware make one.
type customContext struct {
	echo.Context
	account string
}

// TestCustomContext: a Context of the application's own type, made by
// middleware before the adapter, reaches the handler as it is, so that
// its type assertion holds; a panic there releases the key with Recover
// before the adapter.
func TestCustomContext(t *testing.T) {
	var runs atomic.Int64
	e := newEcho()
	e.Use(recoverQuietly, func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error { return next(&customContext{c, "acct_1"}) }
	})
	e.POST("/v1/charges", func(c echo.Context) error {
		cc, ok := c.(*customContext)
		require.True(t, ok, "the application's Context, unwrapped")
		if runs.Add(1) == 1 {
			_ = c.String(http.StatusOK, "partial")
			panic("boom")
		}
		info, _ := idempotency.FromContext(c.Request().Context())
		return c.JSON(http.StatusCreated, map[string]any{"account": cc.account, "attempt": info.Attempt})
	}, idempotencyecho.Middleware(newGuard(), singleTenant))

	assert.Equal(t, http.StatusInternalServerError, post(e, "k1", `{}`).Code)
	rr := post(e, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.JSONEq(t, `{"account":"acct_1","attempt":2}`, rr.Body.String())
	assert.Equal(t, int64(2), runs.Load())
}

// panicky panics on its first run, after writing part of its answer when
// partial is set; then it answers its attempt.
func panicky(runs *atomic.Int64, partial bool) echo.HandlerFunc {
	return func(c echo.Context) error {
		if runs.Add(1) == 1 {
			if partial {
				_ = c.String(http.StatusOK, "partial")
			}
			panic("boom")
		}
		info, _ := idempotency.FromContext(c.Request().Context())
		return c.JSON(http.StatusCreated, map[string]any{"attempt": info.Attempt, "takeover": info.Takeover})
	}
}

// TestPanicReleases: a panicking handler's key is released, whether or
// not it had begun its body: the retry runs the handler again, as a
// takeover, and its answer is the one replayed. middleware.Recover before
// the adapter gets the panic with the response echo had, and answers
// echo's 500, whatever the handler had written to the buffer. A Recover
// after the adapter answers 500 inside it, released too; once the handler
// has begun its body, echo's error handler leaves that as it is, and the
// client gets it, but the key is released all the same: nothing is
// replayed.
func TestPanicReleases(t *testing.T) {
	for _, c := range []struct {
		before, partial bool
		status          int
		body            string
	}{
		{true, false, http.StatusInternalServerError, `{"message":"Internal Server Error"}`},
		{true, true, http.StatusInternalServerError, `{"message":"Internal Server Error"}`},
		{false, false, http.StatusInternalServerError, `{"message":"Internal Server Error"}`},
		{false, true, http.StatusOK, "partial"},
	} {
		t.Run(fmt.Sprintf("recover before %t partial %t", c.before, c.partial), func(t *testing.T) {
			var runs atomic.Int64
			guard := idempotencyecho.Middleware(newGuard(), singleTenant)
			e := newEcho()
			if c.before {
				e.POST("/v1/charges", panicky(&runs, c.partial), recoverQuietly, guard)
			} else {
				e.POST("/v1/charges", panicky(&runs, c.partial), guard, recoverQuietly)
			}
			rr := post(e, "k1", `{}`)
			assert.Equal(t, c.status, rr.Code)
			assert.Equal(t, c.body, strings.TrimSpace(rr.Body.String()))
			assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))

			for range 2 {
				rr = post(e, "k1", `{}`)
				assert.Equal(t, http.StatusCreated, rr.Code)
				assert.JSONEq(t, `{"attempt":2,"takeover":true}`, rr.Body.String())
			}
			assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
			assert.Equal(t, int64(2), runs.Load())
		})
	}
}

// TestPanicReachesRecoverWithTheResponse: the Recover before the adapter
// finds c.Request() and c.Response() as it left them, and its 500 is what
// the client reads, not the empty 200 that echo.WrapMiddleware alone
// gives.
func TestPanicReachesRecoverWithTheResponse(t *testing.T) {
	var runs atomic.Int64
	type seen struct {
		req *http.Request
		res *echo.Response
	}
	var before, recovered seen
	e := newEcho()
	e.Use(middleware.RecoverWithConfig(middleware.RecoverConfig{
		LogErrorFunc: func(c echo.Context, err error, _ []byte) error {
			recovered = seen{c.Request(), c.Response()}
			return err
		},
	}))
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			before = seen{c.Request(), c.Response()}
			return next(c)
		}
	})
	e.POST("/v1/charges", panicky(&runs, true), idempotencyecho.Middleware(newGuard(), singleTenant))

	rr := post(e, "k1", `{}`)
	assert.Equal(t, http.StatusInternalServerError, rr.Code)
	assert.JSONEq(t, `{"message":"Internal Server Error"}`, rr.Body.String())
	assert.Same(t, before.req, recovered.req)
	assert.Same(t, before.res, recovered.res)
}

// TestPanicWithoutRecover: without middleware.Recover the panic goes on to
// net/http, which drops the connection; the key is released, so the retry
// runs the handler.
func TestPanicWithoutRecover(t *testing.T) {
	var runs atomic.Int64
	srv := httptest.NewUnstartedServer(charges(newGuard(), singleTenant, panicky(&runs, true)))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	send := func() (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{}`))
		require.NoError(t, err)
		req.Header.Set(idempotency.HeaderKey, "k1")
		return srv.Client().Do(req)
	}
	_, err := send()
	require.Error(t, err, "net/http drops the connection of a handler that panicked")

	res, err := send()
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	assert.Equal(t, http.StatusCreated, res.StatusCode)
	assert.JSONEq(t, `{"attempt":2,"takeover":true}`, string(b))
	assert.Equal(t, int64(2), runs.Load())
}

// TestResponseOverMaxResponseBytes: a body over MaxResponseBytes reaches
// the client whole; the retry gets its status and header fields without
// it, marked as omitted, and the handler runs once. Middleware before the
// adapter sees the size sent.
func TestResponseOverMaxResponseBytes(t *testing.T) {
	var runs atomic.Int64
	var sizes []int64
	body := strings.Repeat("0123456789", 10)
	e := newEcho()
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			err := next(c)
			sizes = append(sizes, c.Response().Size)
			return err
		}
	})
	e.POST("/v1/charges", func(c echo.Context) error {
		runs.Add(1)
		c.Response().Flush() // sends nothing yet
		return c.Blob(http.StatusCreated, "text/csv", []byte(body))
	}, idempotencyecho.Middleware(newGuard(), idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, MaxResponseBytes: 16}))

	rr := post(e, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.Equal(t, body, rr.Body.String())

	rr = post(e, "k1", `{}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.Empty(t, rr.Body.String())
	assert.Equal(t, "text/csv", rr.Header().Get("Content-Type"))
	assert.Equal(t, "too-large", rr.Header().Get(idempotency.HeaderBodyOmitted))
	assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
	assert.Equal(t, int64(1), runs.Load())
	assert.Equal(t, []int64{int64(len(body)), 0}, sizes)
}

// TestOperationInHandler: c.Request().Context() carries the attempt:
// FromContext, DownstreamKey and Step work in it, and c.Bind reads the
// buffered body. A retry after a release resumes after the recorded step
// with the same downstream key.
func TestOperationInHandler(t *testing.T) {
	var steps atomic.Int64
	type seen struct {
		op, downstream string
		attempt        int
		amount         int
		receipt        string
	}
	var runs []seen
	e := charges(newGuard(), singleTenant, func(c echo.Context) error {
		var in struct{ Amount int }
		if err := c.Bind(&in); err != nil {
			return err
		}
		ctx := c.Request().Context()
		info, ok := idempotency.FromContext(ctx)
		require.True(t, ok)
		dk, err := idempotency.DownstreamKey(ctx, "gateway")
		require.NoError(t, err)
		receipt, err := idempotency.Step(ctx, "charge", func(context.Context) (string, error) {
			return fmt.Sprint("rc_", steps.Add(1)), nil
		})
		require.NoError(t, err)
		runs = append(runs, seen{info.OperationID, dk, info.Attempt, in.Amount, receipt})
		if len(runs) == 1 {
			return echo.NewHTTPError(http.StatusBadGateway, "receipt not sent") // released
		}
		return c.JSON(http.StatusCreated, map[string]any{"receipt": receipt, "amount": in.Amount})
	})
	assert.Equal(t, http.StatusBadGateway, post(e, "k1", `{"amount":7}`).Code)
	assert.JSONEq(t, `{"receipt":"rc_1","amount":7}`, post(e, "k1", `{"amount":7}`).Body.String())

	require.Len(t, runs, 2)
	assert.Equal(t, int64(1), steps.Load(), "the step ran once")
	assert.Equal(t, []int{1, 2}, []int{runs[0].attempt, runs[1].attempt})
	assert.Equal(t, []int{7, 7}, []int{runs[0].amount, runs[1].amount})
	assert.Equal(t, runs[0].op, runs[1].op)
	assert.Equal(t, runs[0].downstream, runs[1].downstream)
	assert.Equal(t, "rc_1", runs[1].receipt)
}

// TestResponse: echo's Response says the truth on both sides of the
// adapter. After it, the handler's Response starts as echo's does and
// counts what the handler wrote to the buffer, while the client's is not
// committed: nothing is sent before the outcome is stored. Before it,
// c.Response() is the client's again once the adapter returns, with the
// status and size sent (the handler's answer, a replay or a refusal), and
// its Before functions run as that is sent; those registered after the
// adapter run as the handler writes.
func TestResponse(t *testing.T) {
	type state struct {
		committed bool
		status    int
		size      int64
	}
	stateOf := func(r *echo.Response) state { return state{r.Committed, r.Status, r.Size} }
	var client *echo.Response
	var sent []state
	var hooks []string
	e := newEcho()
	e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			client = c.Response()
			client.Before(func() {
				hooks = append(hooks, "client")
				c.Response().Header().Set("X-Seen-By", "before")
			})
			err := next(c)
			assert.Same(t, client, c.Response())
			sent = append(sent, stateOf(c.Response()))
			return err
		}
	})
	var inner []state
	after := func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			assert.NotSame(t, client, c.Response())
			c.Response().Before(func() { hooks = append(hooks, "handler") })
			inner = append(inner, stateOf(c.Response()))
			err := next(c)
			inner = append(inner, stateOf(c.Response()))
			return err
		}
	}
	e.POST("/v1/charges", func(c echo.Context) error {
		err := c.JSON(http.StatusCreated, map[string]string{"id": "ch_1"})
		assert.Equal(t, state{false, http.StatusOK, 0}, stateOf(client), "nothing sent yet")
		return err
	}, idempotencyecho.Middleware(newGuard(), singleTenant), after)

	first := post(e, "k1", `{}`)
	require.Equal(t, http.StatusCreated, first.Code)
	n := int64(first.Body.Len())
	assert.Equal(t, []state{{false, http.StatusOK, 0}, {true, http.StatusCreated, n}}, inner)
	assert.Equal(t, "before", first.Header().Get("X-Seen-By"))

	assert.Equal(t, http.StatusCreated, post(e, "k1", `{}`).Code)
	reused := post(e, "k1", `{"amount":1}`)
	require.Equal(t, http.StatusUnprocessableEntity, reused.Code)
	assert.Equal(t, []state{
		{true, http.StatusCreated, n},
		{true, http.StatusCreated, n},
		{true, http.StatusUnprocessableEntity, int64(reused.Body.Len())},
	}, sent)
	assert.Len(t, inner, 2, "the chain after the adapter ran once")
	assert.Equal(t, []string{"handler", "client", "client", "client"}, hooks)
}

// TestPassThrough: a method that is not guarded reaches the handler with
// the request and response echo had, every time, and its error is
// returned to echo, which answers it; so does a request without a key when
// the key is optional. A guarded request without one is refused, and the
// handler does not run.
func TestPassThrough(t *testing.T) {
	for _, optional := range []bool{false, true} {
		t.Run(fmt.Sprintf("optional key %t", optional), func(t *testing.T) {
			var runs atomic.Int64
			var outer struct {
				req  *http.Request
				res  *echo.Response
				errs []error
			}
			e := newEcho()
			e.Use(func(next echo.HandlerFunc) echo.HandlerFunc {
				return func(c echo.Context) error {
					outer.req, outer.res = c.Request(), c.Response()
					err := next(c)
					outer.errs = append(outer.errs, err)
					return err
				}
			}, idempotencyecho.Middleware(newGuard(), idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, OptionalKey: optional}))
			handler := func(c echo.Context) error {
				runs.Add(1)
				assert.Same(t, outer.req, c.Request())
				assert.Same(t, outer.res, c.Response())
				return echo.NewHTTPError(http.StatusTeapot, "balance")
			}
			e.GET("/v1/balance", handler)
			e.POST("/v1/charges", handler)

			for range 2 {
				rr := send(e, http.MethodGet, "/v1/balance", "k1", "")
				assert.Equal(t, http.StatusTeapot, rr.Code)
				assert.JSONEq(t, `{"message":"balance"}`, rr.Body.String())
				assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
			}
			assert.Equal(t, int64(2), runs.Load())
			require.Len(t, outer.errs, 2)
			assert.Error(t, outer.errs[1], "echo answers the error")

			rr := post(e, "", `{}`)
			if optional {
				assert.Equal(t, http.StatusTeapot, rr.Code)
				assert.Equal(t, int64(3), runs.Load())
				assert.Error(t, outer.errs[2])
				return
			}
			assert.Equal(t, http.StatusBadRequest, rr.Code)
			assert.Contains(t, rr.Body.String(), `"code":"missing-key"`)
			assert.Equal(t, int64(2), runs.Load())
			assert.NoError(t, outer.errs[2])
		})
	}
}

// unavailable is a store that cannot be reached.
type unavailable struct{ idempotency.Store }

func (unavailable) Claim(context.Context, idempotency.ClaimRequest) (idempotency.Claim, error) {
	return idempotency.Claim{}, idempotency.ErrUnavailable
}

// TestFailOpen: with FailOpen, a request the store cannot guard runs
// unguarded, as one passed through: echo answers its error, and each
// retry runs it again.
func TestFailOpen(t *testing.T) {
	var runs atomic.Int64
	g := idempotency.New(unavailable{idempotency.NewMemoryStore(idempotency.MemoryOptions{})}, idempotency.Options{})
	e := charges(g, idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, FailOpen: true}, func(c echo.Context) error {
		var in struct{ Amount int }
		if err := c.Bind(&in); err != nil {
			return err
		}
		runs.Add(1)
		return echo.NewHTTPError(http.StatusPaymentRequired, fmt.Sprint("declined ", in.Amount))
	})
	for range 2 {
		rr := post(e, "k1", `{"amount":5}`)
		assert.Equal(t, http.StatusPaymentRequired, rr.Code)
		assert.JSONEq(t, `{"message":"declined 5"}`, rr.Body.String())
		assert.Empty(t, rr.Header().Get(idempotency.HeaderReplayed))
	}
	assert.Equal(t, int64(2), runs.Load())
}

// routes is an Observer that keeps the Route of every call's outcome.
type routes struct {
	mu   sync.Mutex
	seen []string
}

func (o *routes) Observe(_ context.Context, e idempotency.Event) {
	if e.Kind == idempotency.EventOutcome {
		o.mu.Lock()
		o.seen = append(o.seen, e.Route)
		o.mu.Unlock()
	}
}

// TestRoute: the Guard's events name echo's route path, mounted on the
// route or with e.Use, and c.Param works behind the adapter.
func TestRoute(t *testing.T) {
	obs := &routes{}
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{Observer: obs})
	capture := func(c echo.Context) error { return c.String(http.StatusOK, c.Param("id")) }
	onRoute := newEcho()
	onRoute.POST("/v1/charges/:id/capture", capture, idempotencyecho.Middleware(g, singleTenant))
	onEngine := newEcho()
	onEngine.Use(idempotencyecho.Middleware(g, singleTenant))
	onEngine.POST("/v1/refunds/:id", capture)

	assert.Equal(t, "ch_1", send(onRoute, http.MethodPost, "/v1/charges/ch_1/capture", "k1", "").Body.String())
	assert.Equal(t, "re_1", send(onEngine, http.MethodPost, "/v1/refunds/re_1", "k2", "").Body.String())
	assert.Equal(t, []string{"/v1/charges/:id/capture", "/v1/refunds/:id"}, obs.seen)
}

// TestCompletedOutside: a handler that completes the key in its own
// transaction, as postgres.Store.CompleteTx does, and writes nothing is
// answered with what it completed, and so is every retry.
func TestCompletedOutside(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	var runs atomic.Int64
	e := charges(idempotency.New(store, idempotency.Options{}), singleTenant, func(c echo.Context) error {
		runs.Add(1)
		ctx := c.Request().Context()
		resp := idempotency.Response{Status: http.StatusCreated, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"id":"ch_1"}`)}
		return idempotency.CompleteOutside(ctx, store, resp, func(k idempotency.Key, token uint64, retention time.Duration) error {
			return store.Complete(ctx, k, token, resp, retention) // the transaction's commit
		})
	})
	for i := range 2 {
		rr := post(e, "k1", `{}`)
		assert.Equal(t, http.StatusCreated, rr.Code)
		assert.Equal(t, "application/json", rr.Header().Get("Content-Type"))
		assert.Equal(t, `{"id":"ch_1"}`, rr.Body.String())
		assert.Equal(t, i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
	}
	assert.Equal(t, int64(1), runs.Load())
}

// TestUnknownRoutes: on e.Use, the adapter runs after routing for every
// request, one that matches no route among them: echo's 404, and its 405
// for a path whose route takes other methods, is answered inside it, kept
// and replayed, and the key is spent: sent again to the right path, it is
// a key reused. On a group, every path under its prefix is routed to a 404
// of the group's, guarded alike, with the route /v1/*; a path outside it
// is not guarded. On a route, a request for an unknown path never reaches
// the adapter.
func TestUnknownRoutes(t *testing.T) {
	var runs atomic.Int64
	obs := &routes{}
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{Observer: obs})
	onEngine := newEcho()
	onEngine.Use(idempotencyecho.Middleware(g, singleTenant))
	onEngine.POST("/v1/charges", createCharge(&runs))
	onEngine.GET("/v1/balance", createCharge(&runs))
	onGroup := newEcho()
	v1 := onGroup.Group("/v1", idempotencyecho.Middleware(g, singleTenant))
	v1.POST("/charges", createCharge(&runs))
	v1.GET("/balance", createCharge(&runs))
	onRoute := charges(g, singleTenant, createCharge(&runs))

	for _, c := range []struct {
		name     string
		e        *echo.Echo
		path     string
		status   int
		replayed bool
		route    string // of the guarded request's events
	}{
		{"engine", onEngine, "/v1/nowhere", http.StatusNotFound, true, ""},
		{"engine", onEngine, "/v1/balance", http.StatusMethodNotAllowed, true, "/v1/balance"},
		{"group", onGroup, "/v1/nowhere", http.StatusNotFound, true, "/v1/*"},
		{"group", onGroup, "/v1/balance", http.StatusNotFound, true, "/v1/*"},
		{"group", onGroup, "/elsewhere", http.StatusNotFound, false, ""},
		{"route", onRoute, "/v1/nowhere", http.StatusNotFound, false, ""},
	} {
		key := c.name + c.path
		obs.seen = nil
		for i := range 2 {
			rr := send(c.e, http.MethodPost, c.path, key, `{}`)
			assert.Equal(t, c.status, rr.Code, key)
			assert.JSONEq(t, fmt.Sprintf(`{"message":%q}`, http.StatusText(c.status)), rr.Body.String())
			assert.Equal(t, c.replayed && i == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true", key)
		}
		if c.replayed {
			assert.Equal(t, []string{c.route, c.route}, obs.seen, key)
		} else {
			assert.Empty(t, obs.seen, key)
		}
		want := http.StatusCreated // the key is free
		if c.replayed {
			want = http.StatusUnprocessableEntity // the key is spent
		}
		assert.Equal(t, want, post(c.e, key, `{"amount":1}`).Code, key)
	}
	assert.Equal(t, int64(2), runs.Load(), "the charges of the keys left free")
}
