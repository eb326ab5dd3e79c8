package report

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

func TestAdd(t *testing.T) {
	path := filepath.Join(t.TempDir(), "report")
	t.Setenv(Env, path)
	t.Setenv(testserver.RedisServerEnv, "")
	Add(t, Entry{Suite: "faults", Store: "redis", Faults: map[string]int{"reset": 2}, Operations: 7})
	Add(t, Entry{Suite: "fuzz", Case: "FuzzX", FuzzExecs: 9})

	b, err := os.ReadFile(path)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	require.Len(t, lines, 2)
	var first, second Entry
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &first))
	require.NoError(t, json.Unmarshal([]byte(lines[1]), &second))
	assert.Equal(t, Entry{Suite: "faults", Store: "redis", Case: "TestAdd", Faults: map[string]int{"reset": 2}, Operations: 7}, first)
	assert.Equal(t, "FuzzX", second.Case, "a case given is kept")
}

// An entry of a Redis store run on another server says which; the others
// do not.
func TestAddNamesTheServer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "report")
	t.Setenv(Env, path)
	t.Setenv(testserver.RedisServerEnv, "/usr/bin/valkey-server")
	Add(t, Entry{Suite: "restarts", Store: "redis-everysec"})
	Add(t, Entry{Suite: "faults", Store: "postgres"})
	t.Setenv(testserver.RedisServerEnv, "")
	Add(t, Entry{Suite: "restarts", Store: "redis"})

	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var servers []string
	for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
		var e Entry
		require.NoError(t, json.Unmarshal([]byte(line), &e))
		servers = append(servers, e.Server)
	}
	assert.Equal(t, []string{"valkey-server", "", ""}, servers)
}
