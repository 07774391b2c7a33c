package io.lockbroker.client.tests;

import static io.lockbroker.client.tests.ClientTests.async;
import static io.lockbroker.client.tests.ClientTests.check;
import static io.lockbroker.client.tests.ClientTests.equal;
import static io.lockbroker.client.tests.ClientTests.fenceOf;
import static io.lockbroker.client.tests.ClientTests.get;

import io.lockbroker.client.KeyListing;
import io.lockbroker.client.KeyView;
import io.lockbroker.client.Lease;
import io.lockbroker.client.LeaseLostException;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockedException;
import java.io.File;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Optional;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.CompletionException;
import java.util.concurrent.TimeUnit;
import java.util.jar.Attributes;
import java.util.jar.JarFile;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Collectors;

/** Tests of {@code withLease}, inspect, list and force release, {@code fromEnv} and the jars build.sh makes. */
final class ApiTests {
    private ApiTests() {
    }

    /** withLease runs the work under the lease and releases it however the work ends. */
    static void withLeaseRunsWorkThenReleases(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url()); LockBroker other = LockBroker.create(env.url())) {
            String key = env.key("with");
            long fence = broker.withLease(key, Duration.ofSeconds(10), Duration.ZERO,
                    () -> fenceOf(get(env.url() + "/locks/" + key).body()));
            check(fence > 0, "the work ran while the broker showed the lease");
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released after the work");
            RuntimeException unchecked = thrownByWithLease(broker, key, new IllegalStateException("boom"));
            check(unchecked instanceof IllegalStateException, "an unchecked exception is thrown as it is: " + unchecked);
            equal("boom", unchecked.getMessage(), "an unchecked exception is thrown as it is");
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released after an unchecked exception");
            RuntimeException checked = thrownByWithLease(broker, key, new IOException("disk"));
            check(checked instanceof CompletionException, "a checked exception is wrapped: " + checked);
            check(checked.getCause() instanceof IOException, "a checked exception is the cause: " + checked.getCause());
            equal(404, get(env.url() + "/locks/" + key).statusCode(), "released after a checked exception");
            try (Lease held = other.acquire(key, Duration.ofSeconds(10), Duration.ZERO)) {
                boolean[] ran = {false};
                try {
                    broker.withLease(key, Duration.ofSeconds(10), Duration.ofMillis(200), () -> ran[0] = true);
                    throw new AssertionError("worked under a held lock");
                } catch (LockedException e) {
                    check(!ran[0] && held.isHeld(), "the work did not run; the holder still holds it");
                }
            }
        }
    }

    /** What {@code withLease} throws when its work throws {@code thrown}: it must throw. */
    private static RuntimeException thrownByWithLease(LockBroker broker, String key, Exception thrown) {
        try {
            broker.withLease(key, Duration.ofSeconds(10), Duration.ZERO, () -> {
                throw thrown;
            });
        } catch (RuntimeException e) {
            return e;
        }
        throw new AssertionError("the work's exception was swallowed");
    }

    /** A lease lost while the work runs interrupts the work's thread; the call says the lease was lost. */
    static void withLeaseInterruptsWorkWhenLost(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String key = env.key("with-lost");
            Duration ttl = Duration.ofMillis(1500);
            CompletableFuture<Void> started = new CompletableFuture<>();
            CompletableFuture<String> outcome = async(() -> {
                try {
                    broker.withLease(key, ttl, Duration.ZERO, () -> {
                        started.complete(null);
                        Thread.sleep(20_000);
                        return "slept";
                    });
                    return "returned";
                } catch (LeaseLostException e) {
                    return (e.getCause() instanceof InterruptedException ? "interrupted" : "not interrupted")
                            + (Thread.currentThread().isInterrupted() ? ", flag left set" : "") + ": " + e.getMessage();
                }
            });
            started.get(10, TimeUnit.SECONDS);
            equal(204, ClientTests.send("DELETE", env.url() + "/locks/" + key + "?force=true").statusCode(), "force release");
            long t0 = System.nanoTime();
            String result = outcome.get(ttl.toMillis() + 2000, TimeUnit.MILLISECONDS);
            check(result.startsWith("interrupted:") && result.contains(key) && result.contains("404"),
                    "the work was interrupted, the loss reported: " + result);
            check(System.nanoTime() - t0 < TimeUnit.MILLISECONDS.toNanos(ttl.toMillis()), "within the ttl");
        }
    }

    /** inspect, list (every page, and page by page) and force release, for locks and semaphores. */
    static void inspectListAndForceRelease(ClientTests.Env env) throws Exception {
        try (LockBroker broker = LockBroker.create(env.url())) {
            String prefix = env.key("inv") + ":";
            Duration ttl = Duration.ofSeconds(10);
            Lease a = broker.lock(prefix + "a").owner("node-a").ttl(ttl).acquire();
            Lease s1 = broker.acquireShared(prefix + "b", ttl, Duration.ZERO);
            Lease s2 = broker.acquireShared(prefix + "b", ttl, Duration.ZERO);
            Lease permit = broker.acquirePermit(prefix + "sem", 3, ttl, Duration.ZERO);

            KeyView va = broker.inspect(prefix + "a");
            check(va.isHeld() && !va.changed(), "held: " + va);
            equal(a.fence(), va.fence(), "fence");
            equal(Optional.of("node-a"), va.owner(), "owner");
            equal(Optional.of("exclusive"), va.mode(), "mode");
            equal(1, va.holders(), "holders");
            check(va.expiresAt().isPresent(), "its end");
            KeyView vb = broker.inspect(prefix + "b");
            equal(Optional.of("shared"), vb.mode(), "shared mode");
            equal(2, vb.holders(), "shared holders");
            equal(Math.max(s1.fence(), s2.fence()), vb.fence(), "the highest shared fence");
            KeyView free = broker.inspect(prefix + "free");
            check(!free.isHeld() && free.fence() == 0 && free.owner().isEmpty(), "free: " + free);
            KeyView vs = broker.inspectSemaphore(prefix + "sem");
            check(vs.isHeld(), "a permit is held: " + vs);
            equal(3, vs.limit(), "the semaphore's limit");
            equal(1, vs.holders(), "permits taken");
            equal(permit.fence(), vs.fence(), "the permit's fence");

            List<KeyView> all = broker.listLocks(prefix);
            equal(List.of(prefix + "a", prefix + "b"), all.stream().map(KeyView::key).collect(Collectors.toList()),
                    "every held lock under the prefix, in key order");
            equal(a.fence(), all.get(0).fence(), "a listed fence");
            equal(Optional.of("node-a"), all.get(0).owner(), "a listed owner");
            List<String> paged = new ArrayList<>();
            List<Integer> sizes = new ArrayList<>();
            String cursor = null;
            do {
                KeyListing page = broker.listLocks(prefix, 1, cursor);
                page.keys().forEach(v -> paged.add(v.key()));
                sizes.add(page.keys().size());
                cursor = page.nextCursor().orElse(null);
            } while (cursor != null && sizes.size() < 10);
            equal(List.of(prefix + "a", prefix + "b"), paged, "page by page");
            check(sizes.get(0) == 1 && sizes.size() >= 2, "one per page: " + sizes);
            List<KeyView> sems = broker.listSemaphores(prefix);
            equal(1, sems.size(), "one semaphore listed: " + sems);
            equal(3, sems.get(0).limit(), "its limit");
            equal(1, sems.get(0).holders(), "its permits taken");

            CompletableFuture<String> lost = new CompletableFuture<>();
            a.onLost(() -> lost.complete(a.lostReason().orElse("")));
            check(broker.forceRelease(prefix + "a"), "a held lock force-released");
            try {
                a.renew(); // the next renewal finds it gone (a background one would, within a third of the ttl)
                throw new AssertionError("renewed a force-released lease");
            } catch (LeaseLostException e) {
                check(lost.get(5, TimeUnit.SECONDS).contains("404"), "its holder lost it: " + e.getMessage());
            }
            check(!broker.forceRelease(prefix + "a"), "nothing to force-release");
            check(broker.forceReleaseSemaphore(prefix + "sem"), "a semaphore force-released");
            check(!broker.inspectSemaphore(prefix + "sem").isHeld(), "no permit left");
            s1.release();
            s2.release();
            permit.release();
            check(broker.listLocks(prefix).isEmpty(), "nothing listed once released");
        }
    }

    /**
     * fromEnv reads LOCKBROKER_URL and LOCKBROKER_AUTH_TOKEN (never LOCKBROKER_TOKEN, a lock's
     * token under {@code lockbroker run}); without LOCKBROKER_URL it is http://127.0.0.1:8080.
     */
    static void fromEnvReadsUrlAndAuthToken(ClientTests.Env env) throws Exception {
        String secret = "secret-from-env-0123456789";
        try (Processes.Broker own = Processes.Broker.withAuth(Processes.Broker.token("env-app", secret, "", "lock"))) {
            String key = env.key("env");
            String out = runFromEnv(Map.of("LOCKBROKER_URL", own.url(), "LOCKBROKER_AUTH_TOKEN", secret,
                    "LOCKBROKER_TOKEN", "a-lock-token-not-a-bearer"), key);
            check(out.startsWith(own.url() + " fence "), "acquired through LOCKBROKER_URL with LOCKBROKER_AUTH_TOKEN: " + out);
            String defaults = runFromEnv(Map.of("LOCKBROKER_TOKEN", "a-lock-token-not-a-bearer"), "--url-only");
            equal("http://127.0.0.1:8080", defaults.strip(), "the default URL");
        }
    }

    /** Runs {@link FromEnvMain} in a JVM of its own with {@code env} (and no other LOCKBROKER_ variable). */
    private static String runFromEnv(Map<String, String> env, String arg) throws Exception {
        String java = Path.of(System.getProperty("java.home"), "bin", "java").toString();
        ProcessBuilder pb = new ProcessBuilder(java, "-cp", System.getProperty("java.class.path"),
                FromEnvMain.class.getName(), arg).redirectErrorStream(true);
        pb.environment().keySet().removeIf(name -> name.startsWith("LOCKBROKER_"));
        pb.environment().putAll(env);
        pb.redirectInput(ProcessBuilder.Redirect.from(new File("/dev/null")));
        Process process = pb.start();
        String out = new String(process.getInputStream().readAllBytes(), StandardCharsets.UTF_8);
        check(process.waitFor(20, TimeUnit.SECONDS), "the fromEnv program ended");
        equal(0, process.exitValue(), "the fromEnv program's exit status (output: " + out + ")");
        return out;
    }

    /** The jar is versioned as pom.xml says and names its module; sources and javadoc jars are beside it. */
    static void jarsVersionedWithSourcesAndJavadoc(ClientTests.Env env) throws Exception {
        Matcher m = Pattern.compile("<artifactId>lockbroker-client</artifactId>\\s*<version>([^<]+)</version>")
                .matcher(Files.readString(Path.of("pom.xml")));
        check(m.find(), "pom.xml has the client's version");
        String version = m.group(1);
        try (JarFile jar = new JarFile("target/lockbroker-client.jar")) {
            Attributes main = jar.getManifest().getMainAttributes();
            equal("io.lockbroker.client", main.getValue("Automatic-Module-Name"), "Automatic-Module-Name");
            equal(version, main.getValue("Implementation-Version"), "Implementation-Version");
            equal(version, main.getValue("Specification-Version"), "Specification-Version");
            check(main.getValue("Implementation-Title") != null, "Implementation-Title");
            check(jar.getEntry("io/lockbroker/client/LockBroker.class") != null, "the classes");
        }
        equal(version, LockBroker.class.getPackage().getImplementationVersion(), "the version at run time");
        try (JarFile sources = new JarFile("target/lockbroker-client-sources.jar")) {
            check(sources.getEntry("io/lockbroker/client/LockBroker.java") != null, "the sources jar has the sources");
        }
        try (JarFile javadoc = new JarFile("target/lockbroker-client-javadoc.jar")) {
            check(javadoc.getEntry("index.html") != null, "the javadoc jar has an index");
            check(javadoc.getEntry("io/lockbroker/client/LockBroker.html") != null, "the javadoc jar documents LockBroker");
        }
    }
}
