package idempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idempotency-go/idempotency"
)

func ExampleTransport() {
	// A payments API built on the middleware.
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	charges := 0
	api := guard.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charges++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":"ch_%d"}`, charges)
	}))
	// In front of it, a network that loses the first reply, after the
	// charge was made.
	var keys []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys = append(keys, r.Header.Get(idempotency.HeaderKey))
		if len(keys) > 1 {
			api.ServeHTTP(w, r)
			return
		}
		api.ServeHTTP(httptest.NewRecorder(), r)
		if conn, _, err := http.NewResponseController(w).Hijack(); err == nil {
			conn.Close()
		}
	}))
	defer srv.Close()

	client := &http.Client{Transport: &idempotency.Transport{}}
	res, err := client.Post(srv.URL+"/charges", "application/json", strings.NewReader(`{"amount":100}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	fmt.Printf("%d replayed=%s %s\n", res.StatusCode, res.Header.Get(idempotency.HeaderReplayed), body)
	fmt.Println("attempts:", len(keys), "charges:", charges)
	fmt.Println("one key:", keys[0] == keys[1] && keys[1] == res.Request.Header.Get(idempotency.HeaderKey))
	// Output:
	// 201 replayed=true {"charge":"ch_1"}
	// attempts: 2 charges: 1
	// one key: true
}
