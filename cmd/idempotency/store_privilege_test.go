package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
	"github.com/idempotency-go/idempotency/postgres"
)

// docSQLBlock returns the sql block of docs/security.md's PostgreSQL
// section whose first line is first, with its passwords filled in.
func docSQLBlock(t *testing.T, first string) string {
	t.Helper()
	b, err := os.ReadFile("../../docs/security.md")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(b), "\n## Least privilege: PostgreSQL\n")
	require.True(t, ok)
	section, _, _ = strings.Cut(section, "\n## ")
	for _, block := range strings.Split(section, "```sql\n")[1:] {
		if block, _, _ = strings.Cut(block, "```"); strings.HasPrefix(block, first+"\n") {
			return strings.ReplaceAll(block, "'CHANGE-ME'", "'not-checked'")
		}
	}
	t.Fatalf("docs/security.md: no sql block starting %q", first)
	return ""
}

// TestProxyLeastPrivilege: the proxy, run as docs/security.md's runtime
// role, cannot Migrate at start-up and says why; with -no-migrate it
// serves on the table the owner migrated, and the command inspects as that
// role too.
func TestProxyLeastPrivilege(t *testing.T) {
	pg := testserver.StartPostgres(t)
	ctx := t.Context()
	super, err := pgxpool.New(ctx, pg.DSN)
	require.NoError(t, err)
	defer super.Close()
	_, err = super.Exec(ctx, docSQLBlock(t, "-- As a superuser, once."))
	require.NoError(t, err)
	as := func(role string) string { return strings.Replace(pg.DSN, "//postgres@", "//"+role+"@", 1) }
	owner, err := pgxpool.New(ctx, as("idempotency_owner"))
	require.NoError(t, err)
	defer owner.Close()
	require.NoError(t, postgres.New(owner, postgres.Options{}).Migrate(ctx))
	_, err = owner.Exec(ctx, docSQLBlock(t, "-- As idempotency_owner, after its Migrate."))
	require.NoError(t, err)

	u := startUpstream(t)
	flags := []string{"-postgres", as("idempotency_app")}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	code := run(startCtx, append(append([]string{}, flags...), "proxy", "-upstream", u.url,
		"-listen", "127.0.0.1:0", "-admin-listen", "127.0.0.1:0", "-scope-header", "X-Account-ID"),
		strings.NewReader(""), &out, &errOut)
	assert.Equal(t, 1, code, "the proxy started as the runtime role: %s", errOut.String())
	assert.Contains(t, errOut.String(), "permission denied for schema public")

	flags = append(flags, "-no-migrate")
	p := startProxy(t, flags, u)
	decodeCharge(t, post(t, p.url, "/charges", "acct_app", "app-1", `{"amount":100}`))
	p.stop()
	code, stdout, _ := command(t, "", append(flags, "-json", "inspect", "acct_app", "app-1")...)
	require.Equal(t, 0, code)
	var rec jsonRecord
	require.NoError(t, json.Unmarshal([]byte(stdout), &rec), stdout)
	assert.Equal(t, "completed", rec.State)
}
