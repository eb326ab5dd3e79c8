package frameworks_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"

	"github.com/idempotency-go/idempotency"
)

// charge sends one attempt at a charge to h and prints the answer.
func charge(h http.Handler) {
	req := httptest.NewRequest(http.MethodPost, "/v1/charges", strings.NewReader(`{"amount":4200}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Account-ID", "acct_1")
	req.Header.Set("Idempotency-Key", "order-1842")
	rr := httptest.NewRecorder()
	h.ServeHTTP(rr, req)
	fmt.Printf("%d replayed=%q %s\n", rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
}

// newCreateCharge returns a net/http handler that charges, and the count of
// its charges.
func newCreateCharge() (http.HandlerFunc, *int) {
	charges := new(int)
	return func(w http.ResponseWriter, r *http.Request) {
		// The attempt is in the request's context.
		key, err := idempotency.DownstreamKey(r.Context(), "gateway")
		if err != nil {
			http.Error(w, "not guarded", http.StatusInternalServerError)
			return
		}
		_ = key // provider.Charge(r.Context(), amount, key)
		*charges++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":"ch_%d"}`, *charges)
	}, charges
}

// On net/http, the middleware wraps the handler.
func Example_netHTTP() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	createCharge, charges := newCreateCharge()
	guarded := guard.Middleware(idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", guarded(createCharge))

	charge(mux)
	charge(mux)
	fmt.Println("charges:", *charges)
	// Output:
	// 201 replayed="" {"id":"ch_1"}
	// 201 replayed="true" {"id":"ch_1"}
	// charges: 1
}

// Chi takes the middleware as it is. With Use, it guards every POST and
// PATCH the router serves.
func Example_chi() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	createCharge, charges := newCreateCharge()
	r := chi.NewRouter()
	r.Use(middleware.Recoverer) // before the guard: a panic releases the key, then reaches it
	r.Use(guard.Middleware(idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	}))
	r.Post("/v1/charges", createCharge)

	charge(r)
	charge(r)
	fmt.Println("charges:", *charges)
	// Output:
	// 201 replayed="" {"id":"ch_1"}
	// 201 replayed="true" {"id":"ch_1"}
	// charges: 1
}

// With guards only the routes it is given. It runs after routing, so the
// Guard's events carry the route's pattern.
func Example_chiWith() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	captures := 0
	capture := func(w http.ResponseWriter, r *http.Request) {
		captures++
		fmt.Fprintf(w, "captured %s", chi.URLParam(r, "id"))
	}
	guarded := guard.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant})
	r := chi.NewRouter()
	r.With(guarded).Post("/v1/charges/{id}/capture", capture)

	for range 2 {
		req := httptest.NewRequest(http.MethodPost, "/v1/charges/ch_1/capture", nil)
		req.Header.Set("Idempotency-Key", "capture-ch_1")
		rr := httptest.NewRecorder()
		r.ServeHTTP(rr, req)
		fmt.Printf("%d replayed=%q %s\n", rr.Code, rr.Header().Get("Idempotent-Replayed"), rr.Body)
	}
	fmt.Println("captures:", captures)
	// Output:
	// 200 replayed="" captured ch_1
	// 200 replayed="true" captured ch_1
	// captures: 1
}
