package idempotencyecho_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/labstack/echo/v4"
	"github.com/labstack/echo/v4/middleware"

	"github.com/idempotency-go/idempotency"
	idempotencyecho "github.com/idempotency-go/idempotency/echo"
)

// A charge runs once per Idempotency-Key and account, however often the
// client sends it; the retry gets the first answer back. An error the
// handler returns is answered by echo inside the adapter: a 400 forgets
// the key, so the client may correct the request and send it again.
func Example() {
	// In production the store is shared by every instance: a RedisStore.
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	charges := 0
	createCharge := func(c echo.Context) error {
		var in struct{ Amount int }
		if err := c.Bind(&in); err != nil || in.Amount <= 0 {
			return echo.NewHTTPError(http.StatusBadRequest, "amount required")
		}
		// The attempt is in the request's context.
		key, err := idempotency.DownstreamKey(c.Request().Context(), "gateway")
		if err != nil {
			return err
		}
		_ = key // provider.Charge(c.Request().Context(), in.Amount, key)
		charges++
		return c.JSON(http.StatusCreated, map[string]any{"id": fmt.Sprint("ch_", charges), "amount": in.Amount})
	}
	e := echo.New()
	e.Use(middleware.Recover()) // before the adapter: a panic releases the key, then reaches it
	e.POST("/v1/charges", createCharge, idempotencyecho.Middleware(guard, idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	}))

	for _, body := range []string{`{"amount":0}`, `{"amount":4200}`, `{"amount":4200}`} {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Account-ID", "acct_1")
		req.Header.Set("Idempotency-Key", "order-1842")
		rr := httptest.NewRecorder()
		e.ServeHTTP(rr, req)
		fmt.Printf("%d replayed=%q %s", rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
	}
	fmt.Println("charges:", charges)
	// Output:
	// 400 replayed="" {"message":"amount required"}
	// 201 replayed="" {"amount":4200,"id":"ch_1"}
	// 201 replayed="true" {"amount":4200,"id":"ch_1"}
	// charges: 1
}

// On a group, the adapter guards the group's POST and PATCH routes; its
// other methods pass through.
func ExampleMiddleware_group() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	e := echo.New()
	v1 := e.Group("/v1", idempotencyecho.Middleware(guard, idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}))
	runs := 0
	v1.GET("/balance", func(c echo.Context) error { runs++; return c.String(http.StatusOK, fmt.Sprint(runs)) })
	v1.PATCH("/accounts/:id", func(c echo.Context) error {
		runs++
		return c.String(http.StatusOK, fmt.Sprint(c.Param("id"), " ", runs))
	})

	for _, method := range []string{"GET", "GET", "PATCH", "PATCH"} {
		path := map[string]string{"GET": "/v1/balance", "PATCH": "/v1/accounts/acct_1"}[method]
		req := httptest.NewRequest(method, path, strings.NewReader(`{"name":"Ada"}`))
		req.Header.Set("Idempotency-Key", "rename-1")
		rr := httptest.NewRecorder()
		e.ServeHTTP(rr, req)
		fmt.Printf("%s %d replayed=%q %s\n", method, rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
	}
	// Output:
	// GET 200 replayed="" 1
	// GET 200 replayed="" 2
	// PATCH 200 replayed="" acct_1 3
	// PATCH 200 replayed="true" acct_1 3
}
