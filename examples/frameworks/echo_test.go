package frameworks_test

import (
	"io"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"
	"github.com/stretchr/testify/assert"

	"github.com/idempotency-go/idempotency"
	idempotencyecho "github.com/idempotency-go/idempotency/echo"
)

// TestEchoWrapMiddlewareAlone: why echo needs the adapter. Behind
// echo.WrapMiddleware alone, echo answers a returned error only once the
// middleware has stored and sent an empty 200: the client gets it, every
// retry gets it replayed, and the handler never runs again. A panic that
// only the Recover before it catches releases the key, but the client gets
// an empty 200 too, Recover's answer going where no client reads it. The
// adapter, in the same place, gives the client echo's answer, and a 503
// or a panic releases the key: the retry runs the handler.
func TestEchoWrapMiddlewareAlone(t *testing.T) {
	for _, c := range []struct {
		name    string
		fail    func() error
		adapter bool
		status  int
		body    string
		runs    int64 // after a retry
	}{
		{"error", errorOnce, false, http.StatusOK, "", 1},
		{"error", errorOnce, true, http.StatusServiceUnavailable, `{"message":"gateway down"}`, 2},
		{"panic", panicOnce, false, http.StatusOK, "", 2},
		{"panic", panicOnce, true, http.StatusInternalServerError, `{"message":"Internal Server Error"}`, 2},
	} {
		name := c.name + " behind WrapMiddleware"
		if c.adapter {
			name = c.name + " behind the adapter"
		}
		t.Run(name, func(t *testing.T) {
			guard := echo.WrapMiddleware(newGuard().Middleware(singleTenant))
			if c.adapter {
				guard = idempotencyecho.Middleware(newGuard(), singleTenant)
			}
			var runs atomic.Int64
			e := echo.New()
			e.Logger.SetOutput(io.Discard)
			e.Use(middleware.RecoverWithConfig(middleware.RecoverConfig{DisablePrintStack: true}))
			e.POST("/v1/charges", func(ec echo.Context) error {
				if runs.Add(1) == 1 {
					return c.fail()
				}
				return ec.JSON(http.StatusCreated, map[string]string{"id": "ch_1"})
			}, guard)

			rr := post(e, "/v1/charges", "k1", `{}`)
			assert.Equal(t, c.status, rr.Code)
			if c.body == "" {
				assert.Empty(t, rr.Body.String())
			} else {
				assert.JSONEq(t, c.body, rr.Body.String())
			}
			rr = post(e, "/v1/charges", "k1", `{}`)
			assert.Equal(t, c.runs, runs.Load())
			if c.runs == 1 {
				assert.Equal(t, http.StatusOK, rr.Code, "the empty 200 was kept")
				assert.Equal(t, "true", rr.Header().Get(idempotency.HeaderReplayed))
			} else {
				assert.Equal(t, http.StatusCreated, rr.Code, "released")
			}
		})
	}
}

func errorOnce() error { return echo.NewHTTPError(http.StatusServiceUnavailable, "gateway down") }

func panicOnce() error { panic("boom") }
