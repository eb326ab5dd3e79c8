package postgres_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
)

// chargeHandler is a guarded handler that writes a charge and completes its
// record in one transaction, writing nothing itself; fail, when not nil, is
// asked before the commit, and its error rolls the transaction back.
func chargeHandler(f *fixture, s *postgres.Store, table string, fail func(r *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		info, _ := idempotency.FromContext(ctx)
		tx, err := f.pool.Begin(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(ctx, "INSERT INTO "+table+" (operation_id, amount) VALUES ($1, 100)", info.OperationID); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		resp := idempotency.Response{Status: http.StatusCreated,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"charge":"` + info.OperationID + `"}`)}
		if err := s.CompleteTx(ctx, tx, resp); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if fail != nil {
			if err := fail(r); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
		}
	})
}

type answer struct {
	status   int
	replayed string
	body     string
}

func post(t *testing.T, h http.Handler, account, key string) answer {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":100}`))
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("X-Account", account)
	r.Header.Set(idempotency.HeaderKey, key)
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	b, _ := io.ReadAll(w.Result().Body)
	return answer{w.Code, w.Header().Get(idempotency.HeaderReplayed), string(b)}
}

func byAccount(r *http.Request) (string, error) { return r.Header.Get("X-Account"), nil }

// Behind the middleware, a handler completes inside its own transaction with
// the key, token and retention of its context: the client gets exactly what
// was committed, a key sent quoted is the same record as the bare key, and
// scopes stay apart.
func testCompleteTxMiddleware(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Retention: longRetention})
	h := g.Middleware(idempotency.MiddlewareOptions{Scope: byAccount})(chargeHandler(f, s, table, nil))

	first := post(t, h, "acct_1", `"p2"`)
	assert.Equal(t, http.StatusCreated, first.status, first.body)
	assert.Empty(t, first.replayed)
	assert.True(t, strings.HasPrefix(first.body, `{"charge":"op_`), first.body)

	again := post(t, h, "acct_1", "p2")
	assert.Equal(t, answer{http.StatusCreated, "true", first.body}, again, "the bare key replays the quoted key's record")
	assert.Equal(t, 1, count(t, f, table))

	other := post(t, h, "acct_2", `"p2"`)
	assert.Equal(t, http.StatusCreated, other.status, other.body)
	assert.Empty(t, other.replayed, "another account's key is another record")
	assert.NotEqual(t, first.body, other.body)
	assert.Equal(t, 2, count(t, f, table))

	var stored int
	require.NoError(t, f.pool.QueryRow(t.Context(),
		"SELECT count(*) FROM "+o.Table+" WHERE state = 'completed' AND expires_at > now() + interval '50 minutes'").Scan(&stored))
	assert.Equal(t, 2, stored, "completed with the Guard's retention")
}

// An operation that fails after CompleteTx has its record released: when
// its transaction rolled back, the release takes and the retry runs once
// more; when it committed (its answer lost, say), the store refuses the
// release, the client gets 503, and the retry replays what was committed.
func testCompleteTxFailures(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	g := idempotency.New(s, idempotency.Options{Retention: longRetention})
	rollback := true
	h := g.Middleware(idempotency.MiddlewareOptions{Scope: byAccount})(chargeHandler(f, s, table, func(*http.Request) error {
		if rollback {
			return errors.New("the business transaction failed")
		}
		return nil
	}))
	assert.Equal(t, http.StatusInternalServerError, post(t, h, "acct_1", "k1").status)
	assert.Zero(t, count(t, f, table), "rolled back")
	rollback = false
	retry := post(t, h, "acct_1", "k1")
	assert.Equal(t, http.StatusCreated, retry.status, retry.body)
	assert.Empty(t, retry.replayed, "the released record ran again")
	assert.Equal(t, 1, count(t, f, table))

	// A handler that commits and then answers 500 anyway: the outcome is
	// what was committed, never the 500.
	committedThenFail := g.Middleware(idempotency.MiddlewareOptions{Scope: byAccount})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chargeHandler(f, s, table, nil).ServeHTTP(httptest.NewRecorder(), r)
		http.Error(w, "lost the commit's reply", http.StatusInternalServerError)
	}))
	lost := post(t, committedThenFail, "acct_1", "k2")
	assert.Equal(t, http.StatusServiceUnavailable, lost.status, lost.body)
	replay := post(t, h, "acct_1", "k2")
	assert.Equal(t, http.StatusCreated, replay.status, replay.body)
	assert.Equal(t, "true", replay.replayed)
	assert.Equal(t, 2, count(t, f, table), "k2 charged once")
}

// CompleteTx says what is wrong with a context that cannot complete here,
// rather than reporting a lost lease: no operation, another Guard's store,
// or a completion already made.
func testCompleteTxWrongContext(t *testing.T, f *fixture) {
	s, o := f.store(t)
	other, _ := f.store(t)
	charges(t, f, o)
	resp := idempotency.Response{Status: http.StatusCreated}
	inTx := func(ctx context.Context, st *postgres.Store) error {
		tx, err := f.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background())
		return st.CompleteTx(ctx, tx, resp)
	}
	require.ErrorIs(t, inTx(t.Context(), s), idempotency.ErrNoOperation)

	for name, g := range map[string]*idempotency.Guard{
		"memory":        idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{}),
		"another-table": idempotency.New(other, idempotency.Options{}),
	} {
		_, err := g.Do(t.Context(), key("foreign-"+name), fp("x"), func(ctx context.Context) (idempotency.Response, error) {
			return idempotency.Response{}, inTx(ctx, s)
		})
		require.ErrorIs(t, err, idempotency.ErrForeignStore, name)
		assert.NotErrorIs(t, err, idempotency.ErrFenced, name)
	}

	g := idempotency.New(s, idempotency.Options{})
	_, err := g.Do(t.Context(), key("twice"), fp("x"), func(ctx context.Context) (idempotency.Response, error) {
		tx, err := f.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(context.Background())
		require.NoError(t, s.CompleteTx(ctx, tx, resp))
		err = s.CompleteTx(ctx, tx, resp)
		require.ErrorContains(t, err, "already completed")
		return idempotency.Response{}, tx.Commit(ctx)
	})
	require.NoError(t, err)
}

// The takeover of an abandoned record completes in its transaction, as
// attempt 2 with Abandoned set, under the dead attempt's operation ID: one
// charge, answered with that ID.
func testCompleteTxTakeover(t *testing.T, f *fixture) {
	s, o := f.store(t)
	table := charges(t, f, o)
	const lease = 300 * time.Millisecond
	g := idempotency.New(s, idempotency.Options{Lease: lease, Retention: longRetention, WaitTimeout: -1})
	k, print := key("takeover"), fp("takeover")
	// The first owner dies: its record is claimed and never settled.
	_, err := s.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: print, OperationID: "op_dead", Lease: lease, Retention: longRetention})
	require.NoError(t, err)
	var info *idempotency.Info
	require.Eventually(t, func() bool {
		res, err := g.Do(t.Context(), k, print, chargeInTx(f, s, table, func(ctx context.Context) error {
			info, _ = idempotency.FromContext(ctx)
			return nil
		}))
		return err == nil && string(res.Response.Body) == "op_dead"
	}, wakeTimeout, 50*time.Millisecond)
	assert.Equal(t, 2, info.Attempt)
	assert.True(t, info.Abandoned)
	assert.Equal(t, 1, count(t, f, table))
}
