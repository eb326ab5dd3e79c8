package postgres_test

import (
	"context"
	"encoding/json"
	"log"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
)

// A handler that writes its business row and completes its idempotency
// record in one transaction: both commit, or neither. The key, the fencing
// token and the retention come from the request's context, and the
// middleware answers with exactly the response committed. The example is
// compiled but not run: it needs a PostgreSQL server.
func ExampleStore_CompleteTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/payments")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store := postgres.New(pool, postgres.Options{})
	defer store.Close()
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	guard := idempotency.New(store, idempotency.Options{})

	createCharge := func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, err := pool.Begin(ctx)
		if err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable) // 5xx: the key is released
			return
		}
		defer tx.Rollback(context.WithoutCancel(ctx))
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO charges (amount) VALUES (4200) RETURNING id`).Scan(&id); err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		body, _ := json.Marshal(map[string]int64{"id": id, "amount": 4200})
		resp := idempotency.Response{Status: http.StatusCreated,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
		if err := store.CompleteTx(ctx, tx, resp); err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		// Nothing to write: the middleware sends resp.
	}
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", guard.Middleware(idempotency.MiddlewareOptions{
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	})(http.HandlerFunc(createCharge)))
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
