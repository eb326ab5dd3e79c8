package idempotency

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestArchitectureNamesExist: every file, test and method that
// ARCHITECTURE.md names in backquotes exists, so that the document cannot
// drift from the code unnoticed.
func TestArchitectureNamesExist(t *testing.T) {
	doc, err := os.ReadFile("ARCHITECTURE.md")
	require.NoError(t, err)
	files, funcs, methods, fields := map[string]bool{}, map[string]bool{}, map[string]bool{}, map[string]bool{}
	declared := regexp.MustCompile(`(?m)^func (?:\(\w+ \*?(\w+)(?:\[[^]]*\])?\) )?(\w+)`)
	field := regexp.MustCompile(`(?m)^\t(\w+)(?:, \w+)* +[^=(]`)
	require.NoError(t, filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		files[filepath.ToSlash(path)] = true
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range field.FindAllStringSubmatch(string(src), -1) {
			fields[m[1]] = true
		}
		for _, m := range declared.FindAllStringSubmatch(string(src), -1) {
			funcs[m[2]] = true
			if m[1] != "" {
				methods[m[1]+"."+m[2]] = true
			}
		}
		return nil
	}))
	named := regexp.MustCompile("`([^`\\s]+)`")
	test := regexp.MustCompile(`^(?:Test|Example|Fuzz|Benchmark)\w*$`)
	method := regexp.MustCompile(`^\*?([A-Za-z]\w*)\.([a-z]\w*)$`)
	checked := 0
	for _, m := range named.FindAllStringSubmatch(string(doc), -1) {
		name := m[1]
		switch {
		case strings.HasSuffix(name, ".go") || strings.HasSuffix(name, ".lua") || strings.HasSuffix(name, ".sql"):
			assert.True(t, files[name] || anyFileEndsWith(files, "/"+name), "ARCHITECTURE.md names %s, which does not exist", name)
		case test.MatchString(name):
			assert.True(t, funcs[name], "ARCHITECTURE.md names %s, which no test file declares", name)
		case method.MatchString(name):
			mm := method.FindStringSubmatch(name)
			if !hasType(methods, mm[1]) {
				continue // another package's type, such as pgx.Tx
			}
			assert.True(t, methods[mm[1]+"."+mm[2]] || fields[mm[2]], "ARCHITECTURE.md names %s, which is neither a method nor a field of %s", name, mm[1])
		default:
			continue
		}
		checked++
	}
	assert.Greater(t, checked, 100, "the document's names were not found")
}

func anyFileEndsWith(files map[string]bool, suffix string) bool {
	for f := range files {
		if strings.HasSuffix(f, suffix) {
			return true
		}
	}
	return false
}

func hasType(methods map[string]bool, typ string) bool {
	for m := range methods {
		if strings.HasPrefix(m, typ+".") {
			return true
		}
	}
	return false
}

// TestShippedCodeImportsNoTestkit: nothing a user's program compiles
// depends on internal/testkit, which holds test rigs and suites only.
func TestShippedCodeImportsNoTestkit(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	const root = "github.com/idempotency-go/idempotency"
	out, err := exec.Command("go", "list", "-deps", root, root+"/postgres", root+"/grpc", root+"/gin", root+"/echo", root+"/otel", root+"/idempotencytest").CombinedOutput()
	require.NoError(t, err, "%s", out)
	deps := strings.Fields(string(out))
	require.Contains(t, deps, root+"/internal/wire", "go list listed no internal package")
	for _, p := range deps {
		assert.NotContains(t, p, "/internal/testkit/", "shipped code depends on a test rig")
	}
}
