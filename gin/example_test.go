package idempotencygin_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/gin-gonic/gin"

	"github.com/idempotency-go/idempotency"
	idempotencygin "github.com/idempotency-go/idempotency/gin"
)

// A charge runs once per Idempotency-Key and account, however often the
// client sends it; the retry gets the first answer back.
func Example() {
	// In production the store is shared by every instance: a RedisStore.
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	charges := 0
	createCharge := func(c *gin.Context) {
		// c carries the attempt, as c.Request.Context() does.
		key, err := idempotency.DownstreamKey(c, "gateway")
		if err != nil {
			c.AbortWithStatus(http.StatusInternalServerError)
			return
		}
		_ = key // provider.Charge(c, amount, key)
		charges++
		c.JSON(http.StatusCreated, gin.H{"id": fmt.Sprint("ch_", charges)})
	}
	r := gin.New()
	r.ContextWithFallback = true // required: c carries the attempt
	r.Use(gin.Recovery())        // before the adapter: a panic releases the key, then reaches it
	r.POST("/v1/charges", idempotencygin.Middleware(guard, idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	}), createCharge)

	for range 2 {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":4200}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Account-ID", "acct_1")
		req.Header.Set("Idempotency-Key", "order-1842")
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		fmt.Printf("%d replayed=%q %s\n", rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
	}
	fmt.Println("charges:", charges)
	// Output:
	// 201 replayed="" {"id":"ch_1"}
	// 201 replayed="true" {"id":"ch_1"}
	// charges: 1
}

// On a group, the adapter guards the group's POST and PATCH routes; its
// other methods pass through.
func ExampleMiddleware_group() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	r := gin.New()
	r.ContextWithFallback = true
	v1 := r.Group("/v1", idempotencygin.Middleware(guard, idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant}))
	runs := 0
	v1.GET("/balance", func(c *gin.Context) { runs++; c.String(http.StatusOK, "%d", runs) })
	v1.PATCH("/accounts/:id", func(c *gin.Context) { runs++; c.String(http.StatusOK, "%s %d", c.Param("id"), runs) })

	for _, method := range []string{"GET", "GET", "PATCH", "PATCH"} {
		path := map[string]string{"GET": "/v1/balance", "PATCH": "/v1/accounts/acct_1"}[method]
		req := httptest.NewRequest(method, path, strings.NewReader(`{"name":"Ada"}`))
		req.Header.Set("Idempotency-Key", "rename-1")
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		fmt.Printf("%s %d replayed=%q %s\n", method, rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
	}
	// Output:
	// GET 200 replayed="" 1
	// GET 200 replayed="" 2
	// PATCH 200 replayed="" acct_1 3
	// PATCH 200 replayed="true" acct_1 3
}
