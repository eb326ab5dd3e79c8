package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// storeUnderTest is a store the runbook runs against, and the flags that
// name it to the command.
type storeUnderTest struct {
	store idempotency.Store
	stats func(context.Context) (idempotency.Stats, error)
	flags []string
}

func stores(t *testing.T) map[string]func(t *testing.T) storeUnderTest {
	return map[string]func(t *testing.T) storeUnderTest{
		"redis": func(t *testing.T) storeUnderTest {
			r := testserver.StartRedis(t)
			s, err := idempotency.NewRedisStore(r.Client(), idempotency.RedisOptions{})
			require.NoError(t, err)
			t.Cleanup(func() { s.Close() })
			return storeUnderTest{s, s.Stats, []string{"-redis", "redis://" + r.Addr}}
		},
		"redis-cluster": func(t *testing.T) storeUnderTest {
			c := testserver.StartCluster(t, 3, 0)
			s, err := idempotency.NewRedisStore(c.Client(), idempotency.RedisOptions{})
			require.NoError(t, err)
			t.Cleanup(func() { s.Close() })
			return storeUnderTest{s, s.Stats, []string{"-redis-cluster", strings.Join(c.Addrs, ",")}}
		},
		"postgres": func(t *testing.T) storeUnderTest {
			pg := testserver.StartPostgres(t)
			pool, err := pgxpool.New(t.Context(), pg.DSN)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			s := postgres.New(pool, postgres.Options{})
			require.NoError(t, s.Migrate(t.Context()))
			t.Cleanup(s.Close)
			return storeUnderTest{s, s.Stats, []string{"-postgres", pg.DSN}}
		},
	}
}

// command runs the command with args and stdin, and returns its exit code
// and what it printed.
func command(t *testing.T, stdin string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(t.Context(), args, strings.NewReader(stdin), &out, &errOut)
	t.Logf("$ idempotency %s\n%s%s(exit %d)", strings.Join(args, " "), out.String(), errOut.String(), code)
	return code, out.String(), errOut.String()
}

// TestRunbook walks docs/operations.md's runbook for abandoned records on
// each store: a provider outage leaves charges abandoned that the sweeper's
// recovery cannot settle; the alert's gauge (Stats) shows them; the command
// lists them, settles one with the outcome the operator learnt from the
// provider, and releases another; a retry of the first replays that outcome
// and a retry of the second runs the charge.
func TestRunbook(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			ctx := t.Context()
			const lease = 300 * time.Millisecond
			providerDown := func(context.Context) (idempotency.Response, error) {
				return idempotency.Response{}, idempotency.ErrUnknown
			}
			service := idempotency.New(s.store, idempotency.Options{Lease: lease, Recover: providerDown})
			fp := idempotency.FingerprintOf("POST /charges", []byte(`{"amount":100}`))

			// Two instances died mid-charge: their records are left in flight,
			// and the sweeper, which takes each over to recover it (attempt 2),
			// leaves them abandoned while the provider is down.
			for _, k := range []string{"k1", "k2"} {
				c, err := s.store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Scope: "acct_42", Name: k},
					Fingerprint: fp, OperationID: "op_" + k, Lease: lease, Retention: time.Hour})
				require.NoError(t, err)
				require.Equal(t, idempotency.Owner, c.State)
			}
			time.Sleep(2 * lease)
			settled, err := service.Sweep(ctx, 10)
			require.NoError(t, err)
			require.Zero(t, settled, "the sweeper settled a charge while the provider was down")
			st, err := s.stats(ctx)
			require.NoError(t, err)
			require.EqualValues(t, 2, st.Abandoned, "the gauge of the abandoned-records alert")

			code, out, _ := command(t, "", append(s.flags, "list")...)
			require.Zero(t, code)
			assert.Regexp(t, `abandoned\s+"acct_42"\s+k1\s+2`, out)
			assert.Regexp(t, `abandoned\s+"acct_42"\s+k2\s+2`, out)
			code, out, _ = command(t, "", append(s.flags, "stats")...)
			require.Zero(t, code)
			assert.Contains(t, out, "abandoned  2")

			// Asked to confirm, an operator who does not type yes changes nothing.
			code, _, errOut := command(t, "no\n", append(s.flags, "release", "acct_42", "k2")...)
			assert.Equal(t, 1, code)
			assert.Contains(t, errOut, "not confirmed")

			// The provider says k1 was charged: settle it with that answer.
			code, out, _ = command(t, "yes\n", append(s.flags, "-status", "201", "-header", "Content-Type: application/json",
				"-body", `{"id":"ch_1","status":"succeeded"}`, "settle", "acct_42", "k1")...)
			require.Zero(t, code)
			assert.Regexp(t, `state\s+completed`, out)
			// k2 never reached the provider: let its retry run it.
			code, out, _ = command(t, "", append(s.flags, "-yes", "-json", "release", "acct_42", "k2")...)
			require.Zero(t, code)
			var released jsonRecord
			require.NoError(t, json.Unmarshal([]byte(out), &released))
			assert.Equal(t, "released", released.State)

			ran := 0
			charge := func(context.Context) (idempotency.Response, error) {
				ran++
				return idempotency.Response{Status: http.StatusCreated, Body: []byte(`{"id":"ch_2"}`)}, nil
			}
			r, err := service.Do(ctx, idempotency.Key{Scope: "acct_42", Name: "k1"}, fp, charge)
			require.NoError(t, err)
			assert.True(t, r.Replayed)
			assert.Equal(t, http.StatusCreated, r.Response.Status)
			assert.Equal(t, `{"id":"ch_1","status":"succeeded"}`, string(r.Response.Body))
			assert.Equal(t, "application/json", r.Response.Header.Get("Content-Type"))
			assert.Zero(t, ran, "the settled charge ran again")
			r, err = service.Do(ctx, idempotency.Key{Scope: "acct_42", Name: "k2"}, fp, charge)
			require.NoError(t, err)
			assert.False(t, r.Replayed)
			assert.Equal(t, 1, ran, "the released charge did not run")
			st, err = s.stats(ctx)
			require.NoError(t, err)
			assert.Zero(t, st.Abandoned, "the alert's gauge after the runbook")
		})
	}
}

// A record in a layout this version does not write is named as such.
func TestCommandForeignRecord(t *testing.T) {
	r := testserver.StartRedis(t)
	s, err := idempotency.NewRedisStore(r.Client(), idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	k := idempotency.Key{Scope: "acct_1", Name: "old"}
	c, err := s.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: idempotency.FingerprintOf("x", nil),
		OperationID: "op_old", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, c.State)
	keys, err := r.Client().Keys(t.Context(), "idem:*:old").Result()
	require.NoError(t, err)
	require.Len(t, keys, 1)
	require.NoError(t, r.Client().Set(t.Context(), keys[0], "v1:something else", time.Hour).Err())

	code, _, errOut := command(t, "", "-redis", "redis://"+r.Addr, "inspect", "acct_1", "old")
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "not one this version writes")
}

// A live owner's record is acted on only with -force, which fences that
// owner off; a key in the wrong form, a missing record and a store that is
// not the library's get clear errors.
func TestCommandRefusals(t *testing.T) {
	s := stores(t)["postgres"](t)
	ctx := t.Context()
	fp := idempotency.FingerprintOf("POST /charges", nil)
	owner, err := s.store.Claim(ctx, idempotency.ClaimRequest{Key: idempotency.Key{Scope: "acct_1", Name: "busy"},
		Fingerprint: fp, OperationID: "op_busy", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)

	code, _, errOut := command(t, "", append(s.flags, "-yes", "forget", "acct_1", "busy")...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "-force")
	code, _, _ = command(t, "", append(s.flags, "-yes", "-force", "forget", "acct_1", "busy")...)
	require.Zero(t, code)
	assert.ErrorIs(t, s.store.Complete(ctx, idempotency.Key{Scope: "acct_1", Name: "busy"}, owner.Token, idempotency.Response{Status: 201}, time.Hour),
		idempotency.ErrFenced, "the owner of a record forgotten by force")

	code, _, errOut = command(t, "", append(s.flags, "inspect", "acct_1", "has space")...)
	assert.Equal(t, 2, code)
	assert.Contains(t, errOut, "invalid key")
	code, _, errOut = command(t, "", append(s.flags, "inspect", "acct_1", "never")...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "no record")
	code, _, errOut = command(t, "", append(s.flags, "-table", "orders", "stats")...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, `no idempotency table "orders"`)
	code, _, _ = command(t, "", "stats")
	assert.Equal(t, 2, code, "no store named")
	code, _, _ = command(t, "", append(s.flags, "settle", "acct_1", "busy")...)
	assert.Equal(t, 2, code, "settle without -status")
}

// forget erases an operation that may have acted: without -force it says
// what it would erase (the operation ID, the attempts, the recorded steps)
// and changes nothing; with it, the key is new again.
func TestForgetNeedsForce(t *testing.T) {
	for name, open := range stores(t) {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			ctx := t.Context()
			k := idempotency.Key{Scope: "acct_1", Name: "charged"}
			c, err := s.store.Claim(ctx, idempotency.ClaimRequest{Key: k, Fingerprint: idempotency.FingerprintOf("POST /charges", nil),
				OperationID: "op_charged", Lease: time.Minute, Retention: time.Hour})
			require.NoError(t, err)
			points := s.store.(idempotency.RecoveryPointStore)
			require.NoError(t, points.SaveRecoveryPoint(ctx, k, c.Token, idempotency.RecoveryPoint{Step: "charge", Result: []byte(`"ch_1"`)}))
			require.NoError(t, s.store.Release(ctx, k, c.Token))

			code, _, errOut := command(t, "", append(s.flags, "-yes", "forget", "acct_1", "charged")...)
			assert.Equal(t, 1, code)
			assert.Contains(t, errOut, "erases operation op_charged")
			assert.Contains(t, errOut, "(charge)")
			assert.Contains(t, errOut, "-force")
			code, out, _ := command(t, "", append(s.flags, "inspect", "acct_1", "charged")...)
			require.Zero(t, code)
			assert.Contains(t, out, "op_charged", "the record after a refused forget")

			code, _, _ = command(t, "", append(s.flags, "-yes", "-force", "forget", "acct_1", "charged")...)
			require.Zero(t, code)
			code, _, errOut = command(t, "", append(s.flags, "inspect", "acct_1", "charged")...)
			assert.Equal(t, 1, code)
			assert.Contains(t, errOut, "no record")
		})
	}
}
