package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idempotency-go/idempotency"
)

// A production set-up on Redis. The example is compiled but not run: it
// needs a redis-server.
func ExampleNewRedisStore() {
	ctx := context.Background()
	// ContextTimeoutEnabled lets the Guard's deadlines end calls on a
	// silent connection, instead of go-redis's own timeouts.
	client := redis.NewClient(&redis.Options{Addr: "localhost:6379", ContextTimeoutEnabled: true})
	defer client.Close()
	store, err := idempotency.NewRedisStore(client, idempotency.RedisOptions{})
	if err != nil {
		panic(err)
	}
	defer store.Close()
	// A server that may evict the records would let a retry run its
	// operation again: refuse to serve on one.
	if err := store.CheckEviction(ctx); err != nil {
		panic(err)
	}
	// Nor on one that a restart empties (appendonly no), unless a second
	// charge after a restart of Redis is acceptable: then let
	// errors.Is(err, idempotency.ErrNoPersistence) pass.
	keeps, err := store.CheckPersistence(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println(keeps) // what a restart keeps, or "cannot tell", and why
	guard := idempotency.New(store, idempotency.Options{})
	_ = guard // guard.Middleware, guard.Do
}

// A payments API: a charge runs once per Idempotency-Key and account,
// however often the client sends it.
func Example() {
	// In production the store is shared by every instance (see
	// ExampleNewRedisStore).
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
		if _, err := idempotency.DownstreamKey(r.Context(), "gateway"); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
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
	// 422 replayed="" application/problem+json {"type":"https://github.com/idempotency-go/idempotency/blob/main/docs/errors.md#key-reused","title":"Idempotency-Key reused","status":422,"detail":"This Idempotency-Key was used before with a different request.","code":"key-reused"}
	// charges: 1
}

func ExampleGuard_Do() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	ctx := context.Background()

	// A queue consumer: the message id is the key, its payload the request.
	consume := func(id string, payload []byte) {
		res, err := guard.Do(ctx, idempotency.Key{Scope: "acct_1", Name: id}, idempotency.FingerprintOf("charge", payload),
			func(ctx context.Context) (idempotency.Response, error) {
				info, _ := idempotency.FromContext(ctx)
				fmt.Println("charging, attempt", info.Attempt)
				return idempotency.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}, nil
			})
		switch {
		case errors.Is(err, idempotency.ErrMismatch):
			fmt.Println("rejected: the id was used for another payload")
		case err != nil:
			fmt.Println("error:", err)
		default:
			fmt.Printf("%d %s replayed=%v\n", res.Response.Status, res.Response.Body, res.Replayed)
		}
	}
	consume("msg-1", []byte(`{"amount":100,"currency":"usd"}`))
	consume("msg-1", []byte(`{"currency":"usd","amount":100}`)) // redelivered
	consume("msg-1", []byte(`{"amount":999,"currency":"usd"}`))
	// Output:
	// charging, attempt 1
	// 201 {"charge":"ch_1"} replayed=false
	// 201 {"charge":"ch_1"} replayed=true
	// rejected: the id was used for another payload
}

func ExampleGuard_Sweep() {
	// charged stands for asking the payment provider about a key.
	charged := func(downstreamKey string) bool { return downstreamKey != "" }
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	guard := idempotency.New(store, idempotency.Options{
		Lease: 50 * time.Millisecond,
		// Ask the provider what became of an operation whose owner died.
		Recover: func(ctx context.Context) (idempotency.Response, error) {
			key, err := idempotency.DownstreamKey(ctx, "gateway")
			if err != nil {
				return idempotency.Response{}, err
			}
			if charged(key) {
				return idempotency.Response{Status: 201, Body: []byte(`{"charge":"ch_1"}`)}, nil
			}
			idempotency.SetDisposition(ctx, idempotency.Release) // never charged: let a retry run it
			return idempotency.Response{}, nil
		},
	})
	// An owner that dies after charging, before storing its response.
	_, _ = store.Claim(context.Background(), idempotency.ClaimRequest{Key: idempotency.Key{Name: "k"},
		OperationID: "op_1", Lease: 50 * time.Millisecond, Retention: time.Hour})
	time.Sleep(100 * time.Millisecond)

	// In production: a goroutine calling Sweep every few leases.
	settled, err := guard.Sweep(context.Background(), 100)
	fmt.Println("settled", settled, err)
	res, _ := guard.Do(context.Background(), idempotency.Key{Name: "k"}, idempotency.Fingerprint{}, nil)
	fmt.Printf("%d %s replayed=%v\n", res.Response.Status, res.Response.Body, res.Replayed)
	// Output:
	// settled 1 <nil>
	// 201 {"charge":"ch_1"} replayed=true
}
