#!/bin/sh
# One sequence of ACL commands, run in an empty directory on ext4 and on
# keelfs by daemon/tests/acl.rs, which compares the two transcripts.
umask 022
set -x
mkdir d
setfacl -m u:3000:rwx,g:2000:r-x d
setfacl -d -m u:3000:rwx,g:2000:rx,o::- d
getfacl -cn d
stat -c '%A' d
touch d/f
getfacl -cn d/f
stat -c '%A' d/f
mkdir d/sub
getfacl -cn d/sub
stat -c '%A' d/sub
chmod 640 d/f
getfacl -cn d/f
stat -c '%A' d/f
setfacl -m m::r d/f
stat -c '%A' d/f
setfacl -b d/f
getfacl -cn d/f
stat -c '%A' d/f
setfacl -m u::rwx,g::r,o::- d/f
stat -c '%A' d/f
getfattr -m - -d d/f
setfacl -k d
touch d/g
stat -c '%A' d/g
getfacl -cn d/g
setfacl -m u:3000:r d/g
chmod o= d/g
setpriv --reuid=3001 --regid=3001 --clear-groups cat d/g; echo cat=$?
setpriv --reuid=3000 --regid=3000 --clear-groups cat d/g; echo cat=$?
setpriv --reuid=3000 --regid=3000 --clear-groups sh -c 'echo x >> d/g'; echo write=$?
setfacl -m g:2000:rw d/g
setpriv --reuid=3001 --regid=3001 --groups=2000 sh -c 'echo y >> d/g'; echo write=$?
setfacl -m m::r d/g
setpriv --reuid=3001 --regid=3001 --groups=2000 sh -c 'echo z >> d/g'; echo write=$?
getfacl -cn d/g
setfacl -m u:99999:rwx d/nonexistent; echo rc=$?
# The umask applies without a default ACL and is ignored with one.
umask 077
mkdir e
touch e/plain
stat -c '%A' e/plain
setfacl -d -m g::rw,o::r e
touch e/inherit
mkdir e/subdir
stat -c '%A' e/inherit e/subdir
getfacl -cn e/inherit
