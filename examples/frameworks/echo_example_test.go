package frameworks_test

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

// Echo takes the adapter, github.com/idempotency-go/idempotency/echo, which
// answers a handler's returned error inside the middleware, and hands a
// panic to the Recover before it.
func Example_echo() {
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

	// The first attempt is refused, which forgets the key: the client may
	// correct the request and send it again with the same key.
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
