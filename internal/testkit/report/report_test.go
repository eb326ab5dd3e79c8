package report

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAdd(t *testing.T) {
	path := filepath.Join(t.TempDir(), "report")
	t.Setenv(Env, path)
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
