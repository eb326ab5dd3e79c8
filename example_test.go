package idempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idempotency-go/idempotency"
)

func ExampleGuard_Middleware() {
	// In production the store is shared by every instance (NewRedisStore).
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	guarded := guard.Middleware(idempotency.MiddlewareOptions{
		// Keys belong to an account: two accounts never share a record.
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil },
	})

	charges := 0
	mux := http.NewServeMux()
	mux.Handle("POST /charges", guarded(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// A key derived from the operation, the same for every attempt,
		// makes the payment provider deduplicate too.
		_ = idempotency.DownstreamKey(r.Context(), "gateway")
		charges++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":%d}`, charges)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	send := func(body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/charges", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Account", "acct_1")
		req.Header.Set("Idempotency-Key", `"8e03978e-40d5-43e8-bc93-6894a57f9324"`)
		res, err := srv.Client().Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer res.Body.Close()
		b, _ := io.ReadAll(res.Body)
		fmt.Printf("%d replayed=%q %s %s\n", res.StatusCode, res.Header.Get("Idempotent-Replayed"), res.Header.Get("Content-Type"), b)
	}
	send(`{"amount":100}`)
	send(`{"amount":100}`)   // a retry: the same answer, the charge not repeated
	send(`{ "amount":100 }`) // the same JSON
	send(`{"amount":200}`)   // a different request under a used key
	fmt.Println("charges:", charges)
	// Output:
	// 201 replayed="" application/json {"charge":1}
	// 201 replayed="true" application/json {"charge":1}
	// 201 replayed="true" application/json {"charge":1}
	// 422 replayed="" application/problem+json {"type":"https://pkg.go.dev/github.com/idempotency-go/idempotency#ErrMismatch","title":"Idempotency-Key reused","status":422,"detail":"This Idempotency-Key was used before with a different request."}
	// charges: 1
}
