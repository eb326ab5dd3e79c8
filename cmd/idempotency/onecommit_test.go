package main

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/postgres"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// On a table that holds records of both modes, the command sees a record
// of the one-commit mode only once its transaction commits: stats and list
// count and name the lease mode's records in flight, never an open
// one-commit transaction, and inspect, settle, release and forget find no
// record under its key, without waiting for that transaction. Once it
// commits, the record is a completed one like any other: inspect shows it,
// and the actions refuse it as they refuse any completed record.
func TestCommandOneCommit(t *testing.T) {
	s := stores(t)["postgres"](t)
	ctx := t.Context()
	fp := idempotency.FingerprintOf("POST /charges", nil)
	key := func(name string) idempotency.Key { return idempotency.Key{Scope: "acct_1", Name: name} }
	_, err := s.store.Claim(ctx, idempotency.ClaimRequest{Key: key("leased"), Fingerprint: fp, OperationID: "op_leased",
		Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	g := idempotency.New(s.store.(*postgres.Store).OneCommit(), idempotency.Options{})
	runs := map[string]int{}
	charge := func(name string) func(context.Context) (idempotency.Response, error) {
		return func(context.Context) (idempotency.Response, error) {
			runs[name]++
			return idempotency.Response{Status: http.StatusCreated, Body: []byte(`{"id":"ch_` + name + `"}`)}, nil
		}
	}
	_, err = g.Do(ctx, key("done"), fp, charge("done"))
	require.NoError(t, err)
	held, release, ended := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	go func() {
		_, err := g.Do(context.Background(), key("held"), fp, func(context.Context) (idempotency.Response, error) {
			close(held)
			<-release
			return idempotency.Response{Status: http.StatusCreated}, nil
		})
		ended <- err
	}()
	<-held

	code, out, _ := command(t, "", append(s.flags, "stats")...)
	require.Zero(t, code)
	assert.Contains(t, out, "in flight  1\n")
	code, out, _ = command(t, "", append(s.flags, "list")...)
	require.Zero(t, code)
	assert.Contains(t, out, "leased")
	assert.NotContains(t, out, "held")
	code, out, _ = command(t, "", append(s.flags, "inspect", "acct_1", "done")...)
	require.Zero(t, code)
	assert.Regexp(t, `state\s+completed`, out)
	for _, args := range [][]string{
		{"inspect", "acct_1", "held"},
		{"-yes", "-status", "201", "settle", "acct_1", "held"},
		{"-yes", "release", "acct_1", "held"},
		{"-yes", "-force", "forget", "acct_1", "held"},
	} {
		code, _, errOut := command(t, "", append(s.flags, args...)...)
		assert.Equal(t, 1, code, args)
		assert.Contains(t, errOut, "no record", args)
	}
	close(release)
	require.NoError(t, <-ended, "the open transaction commits after the operator's commands")
	code, out, _ = command(t, "", append(s.flags, "inspect", "acct_1", "held")...)
	require.Zero(t, code)
	assert.Regexp(t, `state\s+completed`, out)

	code, _, errOut := command(t, "", append(s.flags, "-yes", "-force", "forget", "acct_1", "done")...)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "completed cannot be acted on")
	res, err := g.Do(ctx, key("done"), fp, charge("done"))
	require.NoError(t, err)
	assert.True(t, res.Replayed)
	assert.Equal(t, 1, runs["done"])
}
