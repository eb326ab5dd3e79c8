package frameworks_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// echoCharges is an echo server whose POST /v1/charges runs handler behind
// the middleware, wired as Example_echo wires it.
func echoCharges(g *idempotency.Guard, o idempotency.MiddlewareOptions, handler echo.HandlerFunc) *echo.Echo {
	e := echo.New()
	e.Logger.SetOutput(io.Discard)
	e.Use(middleware.Recover())
	e.POST("/v1/charges", handler, echo.WrapMiddleware(g.Middleware(o)), answerErrors, middleware.Recover())
	return e
}

var singleTenant = idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}

// echoCharge answers c.JSON 201, counting its runs.
func echoCharge(runs *atomic.Int64) echo.HandlerFunc {
	return func(c echo.Context) error {
		run := runs.Add(1)
		c.Response().Header().Set("X-Charge", fmt.Sprint("ch_", run))
		return c.JSON(http.StatusCreated, map[string]any{"id": fmt.Sprint("ch_", run)})
	}
}

// TestEchoReplay: a retry gets the c.JSON answer of the one run, byte for
// byte, marked replayed.
func TestEchoReplay(t *testing.T) {
	var runs atomic.Int64
	e := echoCharges(newGuard(), singleTenant, echoCharge(&runs))
	first := post(e, "/v1/charges", "k1", `{"amount":1}`)
	require.Equal(t, http.StatusCreated, first.Code)
	assert.JSONEq(t, `{"id":"ch_1"}`, first.Body.String())

	again := post(e, "/v1/charges", "k1", `{"amount":1}`)
	assert.Equal(t, http.StatusCreated, again.Code)
	assert.Equal(t, first.Body.Bytes(), again.Body.Bytes())
	want := first.Header().Clone()
	want.Set(idempotency.HeaderReplayed, "true")
	assert.Equal(t, want, again.Header())
	assert.Equal(t, int64(1), runs.Load())
}

// TestEchoDuplicatesWait: concurrent requests with one key run the handler
// once; every duplicate waits for it and gets its answer.
func TestEchoDuplicatesWait(t *testing.T) {
	const n = 20
	store := newWaitCounter(n - 1)
	var runs atomic.Int64
	charge := echoCharge(&runs)
	e := echoCharges(idempotency.New(store, idempotency.Options{}), singleTenant, func(c echo.Context) error {
		select { // hold the original until every duplicate waits for it
		case <-store.all:
		case <-time.After(10 * time.Second):
		}
		return charge(c)
	})
	answers := concurrently(n, func() *httptest.ResponseRecorder { return post(e, "/v1/charges", "same", `{}`) })
	assert.Equal(t, int64(1), runs.Load(), "handler runs")
	replayed := 0
	for _, a := range answers {
		assert.Equal(t, http.StatusCreated, a.Code)
		assert.JSONEq(t, `{"id":"ch_1"}`, a.Body.String())
		if a.Header().Get(idempotency.HeaderReplayed) == "true" {
			replayed++
		}
	}
	assert.Equal(t, n-1, replayed)
}

// TestEchoKeyReused: the key sent again with another body gets 422, and the
// handler does not run.
func TestEchoKeyReused(t *testing.T) {
	var runs atomic.Int64
	e := echoCharges(newGuard(), singleTenant, echoCharge(&runs))
	require.Equal(t, http.StatusCreated, post(e, "/v1/charges", "k1", `{"amount":1}`).Code)
	rr := post(e, "/v1/charges", "k1", `{"amount":2}`)
	assert.Equal(t, http.StatusUnprocessableEntity, rr.Code)
	assert.Contains(t, rr.Body.String(), `"code":"key-reused"`)
	assert.Equal(t, int64(1), runs.Load())
}

// TestEchoErrors: an error the handler returns is answered inside the
// guard by echo's HTTPErrorHandler, so its status decides the record: a
// 5xx (a plain error is one) releases the key, a refusal forgets it, and
// any other status is kept and replayed as echo answered it.
func TestEchoErrors(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
		body   string
		runs   int64 // after a second request
	}{
		{errors.New("gateway down"), http.StatusInternalServerError, `{"message":"Internal Server Error"}`, 2},
		{echo.NewHTTPError(http.StatusServiceUnavailable, "gateway down"), http.StatusServiceUnavailable, `{"message":"gateway down"}`, 2},
		{echo.NewHTTPError(http.StatusConflict, "busy"), http.StatusConflict, `{"message":"busy"}`, 2},
		{echo.NewHTTPError(http.StatusPaymentRequired, "card declined"), http.StatusPaymentRequired, `{"message":"card declined"}`, 1},
	} {
		t.Run(fmt.Sprint(c.status), func(t *testing.T) {
			var runs atomic.Int64
			e := echoCharges(newGuard(), singleTenant, func(echo.Context) error {
				runs.Add(1)
				return c.err
			})
			for i := range 2 {
				rr := post(e, "/v1/charges", "k1", `{}`)
				assert.Equal(t, c.status, rr.Code)
				assert.JSONEq(t, c.body, rr.Body.String())
				assert.Equal(t, i == 1 && c.runs == 1, rr.Header().Get(idempotency.HeaderReplayed) == "true")
			}
			assert.Equal(t, c.runs, runs.Load())
		})
	}
}

// TestEchoErrorHandlerAfterTheGuard: behind echo.WrapMiddleware alone, echo
// answers a returned error after the guard has stored and sent an empty
// 200, and writes its own answer where no client reads it. This is why
// answerErrors goes after the guard.
func TestEchoErrorHandlerAfterTheGuard(t *testing.T) {
	var runs atomic.Int64
	e := echo.New()
	e.POST("/v1/charges", func(echo.Context) error {
		runs.Add(1)
		return echo.NewHTTPError(http.StatusServiceUnavailable, "gateway down")
	}, echo.WrapMiddleware(newGuard().Middleware(singleTenant)))
	for range 2 {
		rr := post(e, "/v1/charges", "k1", `{}`)
		assert.Equal(t, http.StatusOK, rr.Code)
		assert.Empty(t, rr.Body.String())
	}
	assert.Equal(t, int64(1), runs.Load(), "the empty 200 was kept")
}

// TestEchoPanic: a panic is answered 500 inside the guard by the
// middleware.Recover after it, which releases the key: the retry runs
// again, as the same operation. Recover before the guard alone would
// answer where no client reads it, and the client would get an empty 200.
func TestEchoPanic(t *testing.T) {
	for _, inner := range []bool{true, false} {
		t.Run(fmt.Sprintf("recover inside %t", inner), func(t *testing.T) {
			var runs atomic.Int64
			handler := func(c echo.Context) error {
				if runs.Add(1) == 1 {
					panic("boom")
				}
				info, _ := idempotency.FromContext(c.Request().Context())
				return c.JSON(http.StatusCreated, map[string]any{"attempt": info.Attempt})
			}
			e := echo.New()
			e.Logger.SetOutput(io.Discard)
			e.Use(middleware.Recover())
			guarded := echo.WrapMiddleware(newGuard().Middleware(singleTenant))
			if inner {
				e.POST("/v1/charges", handler, guarded, answerErrors, middleware.Recover())
			} else {
				e.POST("/v1/charges", handler, guarded, answerErrors)
			}
			rr := post(e, "/v1/charges", "k1", `{}`)
			if inner {
				assert.Equal(t, http.StatusInternalServerError, rr.Code)
				assert.JSONEq(t, `{"message":"Internal Server Error"}`, rr.Body.String())
			} else {
				assert.Equal(t, http.StatusOK, rr.Code)
				assert.Empty(t, rr.Body.String())
			}
			rr = post(e, "/v1/charges", "k1", `{}`)
			assert.Equal(t, http.StatusCreated, rr.Code)
			assert.JSONEq(t, `{"attempt":2}`, rr.Body.String())
			assert.Equal(t, int64(2), runs.Load())
		})
	}
}

// TestEchoOperationInHandler: c.Request().Context() carries the attempt,
// and c.Bind reads the buffered body. A retry after a release keeps the
// operation ID and so the downstream key; a step recorded by the first
// attempt is not run again.
func TestEchoOperationInHandler(t *testing.T) {
	var steps atomic.Int64
	var keys []string
	e := echoCharges(newGuard(), singleTenant, func(c echo.Context) error {
		var in struct{ Amount int }
		if err := c.Bind(&in); err != nil {
			return err
		}
		ctx := c.Request().Context()
		info, ok := idempotency.FromContext(ctx)
		if !ok {
			return errors.New("no operation")
		}
		dk, err := idempotency.DownstreamKey(ctx, "gateway")
		if err != nil {
			return err
		}
		keys = append(keys, dk)
		receipt, err := idempotency.Step(ctx, "charge", func(ctx context.Context) (string, error) {
			return fmt.Sprint("rc_", steps.Add(1)), nil
		})
		if err != nil || info.Attempt == 1 {
			return echo.NewHTTPError(http.StatusBadGateway, "receipt not sent")
		}
		return c.JSON(http.StatusCreated, map[string]any{"amount": in.Amount, "receipt": receipt, "attempt": info.Attempt})
	})
	assert.Equal(t, http.StatusBadGateway, post(e, "/v1/charges", "k1", `{"amount":7}`).Code)
	rr := post(e, "/v1/charges", "k1", `{"amount":7}`)
	assert.Equal(t, http.StatusCreated, rr.Code)
	assert.JSONEq(t, `{"amount":7,"receipt":"rc_1","attempt":2}`, rr.Body.String())
	assert.Equal(t, int64(1), steps.Load())
	require.Len(t, keys, 2)
	assert.Equal(t, keys[0], keys[1])
}
